"""The launch scripts under examples/, run in their dry-run mode: the flags each would start with."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

from megatron.arguments import run_config_from_argv
from megatron.config import RunConfig
from tests.helpers.paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"


def script_argv(script, tmp_path, env_extra) -> tuple[int, list[str]]:
    """``bash script`` with DRY_RUN set (and ``env_extra``): the world size it would launch and its argv."""
    out = tmp_path / f"{script.name}.argv"
    env = dict(os.environ, DRY_RUN=str(out), RUN_ROOT=str(tmp_path / "runs"), RUN_DIR=str(tmp_path / "run"),
               PY=sys.executable, BACKEND="gloo", **env_extra)
    for name in ("SLURM_NNODES", "SLURM_JOB_ID", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{script}: {proc.stdout}\n{proc.stderr}"
    world_size, *argv = out.read_text().split("\0")[:-1]
    return int(world_size), argv


def stand_in_run_config(argv, world_size) -> RunConfig:
    """The scripts' tokenizer files are stand-ins: check the flags without building the vocabulary."""
    return run_config_from_argv(argv, world_size=world_size, with_vocab=False)


def sbatch_option(script, name) -> str:
    """The value of ``#SBATCH --name`` in ``script``."""
    match = re.search(rf"^#SBATCH --{name}[= ](\S+)", script.read_text(), re.MULTILINE)
    assert match, f"{script} has no #SBATCH --{name}"
    return match.group(1)


def train_cpu_example(script_name: str, tmp_path, env_extra: dict, flags: list[str]) -> tuple[str, list[float]]:
    """Run examples/``script_name`` on the tiny corpus (RUN_DIR = tmp_path / "run", gloo on the CPU) with
    ``env_extra`` and ``flags`` (each iteration logged); its stdout and the logged training losses."""
    from megatron.testing.tiny_corpus import make_tiny_corpus

    corpus = make_tiny_corpus(str(tmp_path / "corpus"))
    env = dict(os.environ, PY=sys.executable, RUN_DIR=str(tmp_path / "run"), DATA_PREFIX=corpus["data_prefix"],
               VOCAB_FILE=corpus["vocab_file"], MERGE_FILE=corpus["merge_file"], DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", **env_extra)
    proc = subprocess.run(["bash", str(EXAMPLES / script_name), "--log-interval", "1", *flags], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    losses = [float(line.split("lm loss:")[1].split("|")[0]) for line in proc.stdout.splitlines() if "lm loss:" in line]
    return proc.stdout, losses


def sentencepiece_stand_ins(directory, dataset_name: str) -> dict:
    """DATA_PREFIX and TOKENIZER_MODEL for a script that reads a SentencePiece tokenizer.model: a stand-in
    dataset ``directory / dataset_name`` and a small BPE SentencePiece model (the scripts pad the vocabulary to
    their model's rows either way)."""
    from megatron.data.tokenizers import train_sentencepiece_tokenizer
    from megatron.testing.tiny_corpus import make_text, write_stand_in_dataset

    tokenizer = train_sentencepiece_tokenizer(make_text(200, seed=0), 500, directory / "spm", model_type="bpe")
    return {"DATA_PREFIX": write_stand_in_dataset(directory / dataset_name),
            "TOKENIZER_MODEL": tokenizer["tokenizer_model"]}


def dry_run_report(argv: list[str], world_size: int, out, *flags: str) -> tuple[int, dict]:
    """``pretrain_gpt.py <argv> --dry-run --world-size N <flags>``: its exit status and the JSON report (in ``out``)."""
    from megatron.dry_run import dry_run

    status = dry_run(argv + ["--dry-run", "--world-size", str(world_size), *flags, "--dry-run-json", str(out)],
                     out=io.StringIO())
    return status, json.loads(out.read_text())

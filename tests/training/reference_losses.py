"""Reference losses of three fixed runs, recorded once and compared bit for bit after refactors.

    python -m tests.training.reference_losses --write   # record (before a change), into golden/
    python -m tests.training.reference_losses            # compare this tree against the record

The runs: the tiny BLOOM of ``tiny_argv`` for 20 iterations on (TP, PP, DP) = (1,1,1) fp32,
(2,2,2) fp32 and (2,2,2) bf16. The (2,2,2) bf16 run also saves at iteration 10; that checkpoint is
kept in ``golden/ckpt_222_bf16`` so that a later tree proves it still resumes a checkpoint written
by an older one (``test_reference_losses.py``).

Bit-for-bit equality holds on the machine kind the record was made on (the same CPU flags and
torch / deepspeed versions): kernels differ between ISAs. Elsewhere the comparison is within
``TOLERANCE``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import sys
import tempfile

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent / "golden"
GOLDEN_FILE = GOLDEN_DIR / "reference_losses.json"
CHECKPOINT_DIR = GOLDEN_DIR / "ckpt_222_bf16"
ITERS = 20
SAVE_AT = 10
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # relative, off the recording machine kind
RUNS = {"111_fp32": (1, 1, False), "222_fp32": (2, 2, False), "222_bf16": (2, 2, True)}


def machine() -> dict:
    """What decides whether results can be bit-identical: the CPU's vector features and the versions."""
    import deepspeed
    import torch

    with open("/proc/cpuinfo") as f:
        flags = sorted(set(re.findall(r"\b(amx\w*|avx512_bf16|avx512f|avx2)\b", f.read())))
    return {"cpu_flags": flags, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "python": platform.python_version()}


def run_argv(corpus: dict, tp: int, pp: int, bf16: bool, save: str | None = None) -> list[str]:
    from tests.training.conftest import tiny_argv

    extra = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if bf16:
        extra.append("--bf16")
    if save:
        extra += ["--save", save, "--save-interval", str(SAVE_AT)]
    return tiny_argv(corpus, *extra, train_iters=ITERS)


def _train(rank, world_size, runs):
    from megatron.arguments import build_run_config, parse_args, resolve_vocab_size
    from megatron.training.pretrain import pretrain

    out = []
    for argv in runs:
        result = pretrain(resolve_vocab_size(build_run_config(parse_args(argv, world_size=world_size))))
        out.append({"losses": [r.loss for r in result.history], "grad_norms": [r.grad_norm for r in result.history]})
    return out


def measure(corpus: dict, save_dir: str | None = None) -> dict:
    """{run name: {'losses', 'grad_norms'}} of the three runs, as rank world-1 sees them."""
    from megatron.testing import run_distributed

    (single,) = run_distributed(_train, world_size=1, args=([run_argv(corpus, 1, 1, False)],), timeout=600)[0]
    runs = [run_argv(corpus, 2, 2, False), run_argv(corpus, 2, 2, True, save=save_dir)]
    fp32, bf16 = run_distributed(_train, world_size=8, args=(runs,), timeout=1200)[-1]
    return {"111_fp32": single, "222_fp32": fp32, "222_bf16": bf16}


def compare(recorded: dict, measured: dict, exact: bool) -> list[str]:
    """Differences between two ``measure`` results, one line each (empty: they agree)."""
    problems = []
    for name, (_, _, bf16) in RUNS.items():
        tolerance = 0.0 if exact else TOLERANCE["bf16" if bf16 else "fp32"]
        for key in ("losses", "grad_norms"):
            want, got = recorded[name][key], measured[name][key]
            if len(want) != len(got):
                problems.append(f"{name} {key}: {len(got)} values, recorded {len(want)}")
                continue
            for i, (a, b) in enumerate(zip(want, got)):
                if a != b and not abs(a - b) <= tolerance * abs(a):
                    problems.append(f"{name} iteration {i + 1} {key}: {b!r}, recorded {a!r}")
    return problems


def main(argv=None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the reference (overwrites golden/)")
    args = parser.parse_args(argv)
    from megatron.testing.corpus import make_tiny_corpus

    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_tiny_corpus(os.path.join(tmp, "corpus"))
        save = os.path.join(tmp, "ckpt") if args.write else None
        measured = measure(corpus, save)
        if args.write:
            GOLDEN_DIR.mkdir(exist_ok=True)
            shutil.rmtree(CHECKPOINT_DIR, ignore_errors=True)
            CHECKPOINT_DIR.mkdir()
            tag = f"global_step{SAVE_AT}"
            shutil.copytree(os.path.join(save, tag), CHECKPOINT_DIR / tag)
            (CHECKPOINT_DIR / "latest").write_text(tag)
            GOLDEN_FILE.write_text(json.dumps({"machine": machine(), "iterations": ITERS, "runs": measured},
                                              indent=1) + "\n")
            print(f"wrote {GOLDEN_FILE} and {CHECKPOINT_DIR}")
            return 0
    recorded = json.loads(GOLDEN_FILE.read_text())
    exact = recorded["machine"] == machine()
    problems = compare(recorded["runs"], measured, exact)
    print(json.dumps({"exact": exact, "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Reference losses of three fixed runs, recorded once per machine kind and compared bit for bit after refactors.

    python -m tests.helpers.reference_losses --write   # record anew (before a change), into tests/training/golden/
    python -m tests.helpers.reference_losses --add-machine  # add this machine kind's record (same tree, same checkpoint)
    python -m tests.helpers.reference_losses            # compare this tree against the record

The runs: the tiny BLOOM of ``tiny_argv`` for 20 iterations on (TP, PP, DP) = (1,1,1) fp32,
(2,2,2) fp32 and (2,2,2) bf16. The (2,2,2) bf16 run also saved at iteration 10; that checkpoint,
written by the tree before the structure refactor (this project's first pipeline numbering), is
kept in ``tests/training/golden/ckpt_222_bf16``; the comparison converts it to BLOOM's numbering with
tools/convert_checkpoint/upgrade_layout.py and resumes it for iterations 11..20: a later tree still
continues the checkpoints of an older one exactly.
``tests/training/test_reference_losses.py`` runs the comparison in the suite.

Bit-for-bit equality holds on a machine kind a record was made on (the same CPU flags and torch / deepspeed
versions): kernels differ between ISAs. The file holds one record per kind (``records``, the first written with
the checkpoint); on a kind without one the comparison is against the first record, within ``run_tolerance``
(megatron/testing/tolerance.py). A record of a later kind keeps its own '222_bf16_resumed': the old checkpoint,
resumed with that kind's kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile

import torch

from megatron.testing.tiny_corpus import make_tiny_corpus, tiny_argv
from megatron.testing.tolerance import run_tolerance
from tests.helpers.paths import REPO_ROOT
from tests.helpers.training import TINY_LAYERS, TINY_WIDTH, train

GOLDEN_DIR = REPO_ROOT / "tests" / "training" / "golden"
GOLDEN_FILE = GOLDEN_DIR / "reference_losses.json"
CHECKPOINT_DIR = GOLDEN_DIR / "ckpt_222_bf16"
ITERS = 20
SAVE_AT = 10
RUNS = {"111_fp32": (1, 1, False), "222_fp32": (2, 2, False), "222_bf16": (2, 2, True)}


def machine() -> dict:
    """What decides whether results can be bit-identical: the CPU's vector features, the kernels torch runs on
    them (``ATEN_CPU_CAPABILITY`` may choose narrower ones) and the versions."""
    import deepspeed

    with open("/proc/cpuinfo") as f:
        flags = sorted(set(re.findall(r"\b(amx\w*|avx512_bf16|avx512f|avx2)\b", f.read())))
    return {"cpu_flags": flags, "kernels": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "python": platform.python_version()}


def run_argv(corpus: dict, tp: int, pp: int, bf16: bool, save: str | None = None, load: str | None = None) -> list[str]:
    extra = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if bf16:
        extra.append("--bf16")
    if save:
        extra += ["--save", save, "--save-interval", str(SAVE_AT)]
    if load:
        extra += ["--load", load]
    return tiny_argv(corpus, *extra, train_iters=ITERS)


def measure(corpus: dict, save_dir: str | None = None, resume_from: str | None = None) -> dict:
    """{run name: {'losses', 'grad_norms'}} of the three runs, as rank world-1 sees them; with
    ``resume_from`` (a copy of ``CHECKPOINT_DIR``) also '222_bf16_resumed': iterations 11..20 of the
    bf16 run, resumed from that checkpoint (in the same 8-process launch)."""
    from megatron.testing import run_distributed

    (single,) = run_distributed(train, world_size=1, args=([run_argv(corpus, 1, 1, False)],), timeout=600)[0]
    runs = [run_argv(corpus, 2, 2, False), run_argv(corpus, 2, 2, True, save=save_dir)]
    if resume_from:
        runs.append(run_argv(corpus, 2, 2, True, load=resume_from))
    fp32, bf16, *resumed = run_distributed(train, world_size=8, args=(runs,), timeout=1200)[-1]
    single, fp32, bf16, *resumed = ({key: run[key] for key in ("losses", "grad_norms")}
                                    for run in (single, fp32, bf16, *resumed))
    out = {"111_fp32": single, "222_fp32": fp32, "222_bf16": bf16}
    if resumed:
        out["222_bf16_resumed"] = resumed[0]
    return out


def upgraded_checkpoint(out_dir: str) -> str:
    """``CHECKPOINT_DIR`` (this project's first layout) converted to BLOOM's numbering in ``out_dir``."""
    from tools.convert_checkpoint.upgrade_layout import upgrade

    upgrade(str(CHECKPOINT_DIR), out_dir)
    return out_dir


def record_for(golden: dict) -> tuple[dict, bool]:
    """The record to compare this machine with, and whether the comparison is exact (a record of this kind)."""
    here = machine()
    for record in golden["records"]:
        if record["machine"] == here:
            return record, True
    return golden["records"][0], False


def compare(recorded: dict, measured: dict, exact: bool) -> list[str]:
    """Differences between a record's runs and ``measure``'s, one line each (empty: they agree); a resumed run
    is compared with the record's own resumed run where it has one, else with the recorded iterations after the
    checkpoint."""
    problems = []
    for name, (_, _, bf16) in RUNS.items():
        for key in ("losses", "grad_norms"):
            problems += _differences(name, key, recorded[name][key], measured[name][key], exact, bf16, first=1)
    if "222_bf16_resumed" in measured:
        own = recorded.get("222_bf16_resumed")
        for key in ("losses", "grad_norms"):
            want = own[key] if own else recorded["222_bf16"][key][SAVE_AT:]
            problems += _differences("222_bf16_resumed", key, want, measured["222_bf16_resumed"][key], exact, True,
                                     first=SAVE_AT + 1)
    return problems


def _differences(name: str, key: str, want: list, got: list, exact: bool, bf16: bool, first: int) -> list[str]:
    problems = []
    if len(want) != len(got):
        return [f"{name} {key}: {len(got)} values, recorded {len(want)}"]
    dtype = torch.bfloat16 if bf16 else torch.float32
    for i, (a, b) in enumerate(zip(want, got)):
        rel = 0.0 if exact else run_tolerance(dtype, TINY_LAYERS, TINY_WIDTH, i + first)
        if a != b and not abs(a - b) <= rel * abs(a):
            problems.append(f"{name} iteration {i + first} {key}: {b!r}, recorded {a!r}")
    return problems


def main(argv=None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="record anew (overwrites golden/, its checkpoint too)")
    what.add_argument("--add-machine", action="store_true",
                      help="add (or replace) this machine kind's record; the checkpoint and other records stay")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_tiny_corpus(os.path.join(tmp, "corpus"))
        save = os.path.join(tmp, "ckpt") if args.write else None
        resume = None if args.write else upgraded_checkpoint(os.path.join(tmp, "old_ckpt"))
        measured = measure(corpus, save, resume)
        if args.write:
            GOLDEN_DIR.mkdir(exist_ok=True)
            shutil.rmtree(CHECKPOINT_DIR, ignore_errors=True)
            CHECKPOINT_DIR.mkdir()
            tag = f"global_step{SAVE_AT}"
            shutil.copytree(os.path.join(save, tag), CHECKPOINT_DIR / tag)
            (CHECKPOINT_DIR / "latest").write_text(tag)
            _write({"iterations": ITERS, "records": [{"machine": machine(), "runs": measured}]})
            print(f"wrote {GOLDEN_FILE} and {CHECKPOINT_DIR}")
            return 0
    golden = json.loads(GOLDEN_FILE.read_text())
    if args.add_machine:
        others = [r for r in golden["records"] if r["machine"] != machine()]
        golden["records"] = others[:1] + [{"machine": machine(), "runs": measured}] + others[1:]
        _write(golden)
        print(f"added this machine's record to {GOLDEN_FILE}: {machine()}")
        return 0
    recorded, exact = record_for(golden)
    problems = compare(recorded["runs"], measured, exact)
    print(json.dumps({"exact": exact, "problems": problems}, indent=1))
    return 1 if problems else 0


def _write(golden: dict) -> None:
    GOLDEN_FILE.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""Reference losses of three fixed runs, recorded once and compared bit for bit after refactors.

    python -m tests.helpers.reference_losses --write   # record (before a change), into tests/training/golden/
    python -m tests.helpers.reference_losses            # compare this tree against the record

The runs: the tiny BLOOM of ``tiny_argv`` for 20 iterations on (TP, PP, DP) = (1,1,1) fp32,
(2,2,2) fp32 and (2,2,2) bf16. The (2,2,2) bf16 run also saved at iteration 10; that checkpoint,
written by the tree before the structure refactor (this project's first pipeline numbering), is
kept in ``tests/training/golden/ckpt_222_bf16``; the comparison converts it to BLOOM's numbering with
tools/convert_checkpoint/upgrade_layout.py and resumes it for iterations 11..20: a later tree still
continues the checkpoints of an older one exactly.
``tests/training/test_reference_losses.py`` runs the comparison in the suite.

Bit-for-bit equality holds on the machine kind the record was made on (the same CPU flags and
torch / deepspeed versions): kernels differ between ISAs. Elsewhere the comparison is within
``TOLERANCE``.
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

from megatron.testing.corpus import make_tiny_corpus, tiny_argv
from tests.helpers.paths import REPO_ROOT
from tests.helpers.training import train

GOLDEN_DIR = REPO_ROOT / "tests" / "training" / "golden"
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
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        flags = [f for f in flags if f == "avx2"]  # ATEN_CPU_CAPABILITY=avx2: the kernels of an AVX2-only CPU
    return {"cpu_flags": flags, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "python": platform.python_version()}


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


def compare(recorded: dict, measured: dict, exact: bool) -> list[str]:
    """Differences between two ``measure`` results, one line each (empty: they agree); a resumed run
    is compared with the recorded iterations after the checkpoint."""
    problems = []
    for name, (_, _, bf16) in RUNS.items():
        tolerance = 0.0 if exact else TOLERANCE["bf16" if bf16 else "fp32"]
        for key in ("losses", "grad_norms"):
            want, got = recorded[name][key], measured[name][key]
            problems += _differences(name, key, want, got, tolerance, first=1)
    if "222_bf16_resumed" in measured:
        for key in ("losses", "grad_norms"):
            want, got = recorded["222_bf16"][key][SAVE_AT:], measured["222_bf16_resumed"][key]
            problems += _differences("222_bf16_resumed", key, want, got, 0.0 if exact else TOLERANCE["bf16"],
                                     first=SAVE_AT + 1)
    return problems


def _differences(name: str, key: str, want: list, got: list, tolerance: float, first: int) -> list[str]:
    problems = []
    if len(want) != len(got):
        return [f"{name} {key}: {len(got)} values, recorded {len(want)}"]
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b and not abs(a - b) <= tolerance * abs(a):
            problems.append(f"{name} iteration {i + first} {key}: {b!r}, recorded {a!r}")
    return problems


def main(argv=None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the reference (overwrites golden/)")
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

"""What every benchmark here reports besides its figures: machine, load, library versions, commit.

    result = {"benchmark": "...", "config": {...}, ...}
    emit(result, args.output)   # prints ONE JSON line; also writes it to --output if given
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    """The machine a result was measured on: the CPU, the instruction-set flags that decide its CPU kind (AMX,
    AVX-512 BF16, AVX-512, AVX2: ``megatron.config.hardware.cpu_bf16_flags``), the kernels torch runs (its
    capability, and ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA where they hold it below the CPU's), and the load."""
    import torch  # noqa: PLC0415 (the scripts import it anyway; this module stays light for its other helpers)

    from megatron.config.hardware import cpu_bf16_flags  # noqa: PLC0415

    limits = {name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if name in os.environ}
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpu_flags": cpu_bf16_flags(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "kernel_limits": limits,
            "loadavg": list(os.getloadavg()), "platform": platform.platform(), "python": platform.python_version()}


def versions() -> dict:
    out = {}
    for name in ("torch", "deepspeed", "transformers", "numpy"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing optional library is reported, not fatal
            out[name] = None
    return out


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def emit(result: dict, output: str | None = None) -> None:
    result.setdefault("date", datetime.date.today().isoformat())
    result.setdefault("commit", commit())
    result.setdefault("versions", versions())
    result["machine_at_end"] = machine()
    line = json.dumps(result, sort_keys=True)
    print(line, flush=True)
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            f.write(line + "\n")


def tiny_corpus(path: str | None = None) -> dict:
    from megatron.testing.tiny_corpus import make_tiny_corpus

    return make_tiny_corpus(path or os.path.join(REPO, "data_cache", "bench_tiny_corpus"))


def tiny_argv(corpus: dict, **flags) -> list[str]:
    """The tests' tiny BLOOM-style flags (megatron.testing.tiny_argv) with overrides."""
    from megatron.testing.tiny_corpus import tiny_argv as argv

    return argv(corpus, **flags)

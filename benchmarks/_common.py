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
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "platform": platform.platform(), "python": platform.python_version()}


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

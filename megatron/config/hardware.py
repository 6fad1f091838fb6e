"""What this machine computes fast: bf16 hardware or not, read from the CPU's flags (or CUDA); GPUs' bf16 peaks.

On a CPU with AVX-512 BF16 or AMX a bf16 matmul is several times faster than fp32; on one with AVX2
only (many AMD EPYC machines) bf16 is emulated and a training step several times slower than in fp32
(README.md: 5.0 s against 0.97 s per iteration of the main job, kernels limited to AVX2). ``fast_bf16``
says which, with the reason in words, so that the main job (``examples/pretrain_tiny_bloom_cpu.sh``) and
the benchmarks can pick and report the precision.

``ATEN_CPU_CAPABILITY`` (torch's kernels) and ``ONEDNN_MAX_CPU_ISA`` (oneDNN's matmuls) limiting
the instruction set below AVX-512 are honoured: with them a machine that has the instructions
behaves as one without, which is how the AVX2-only case is measured on a machine with AVX-512.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

__all__ = ["cpu_bf16_flags", "fast_bf16", "default_precision", "PEAK_BF16_TFLOPS"]

# Dense bf16 tensor-core peak per GPU, TFLOP/s (datasheet values, SXM parts; sparsity not counted): what MFU
# divides by (megatron.training.metrics) and what the planner's GPUs compute at (megatron.planner.specs).
PEAK_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# ONEDNN_MAX_CPU_ISA values at or above the first ISA with bf16 instructions.
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX",
                     "AVX10_1_512_AMX_FP16", "AVX10_2_512_AMX_2", "ALL")


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The bf16-related instruction-set flags the CPU reports (empty where it has none or no cpuinfo)."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return []
    flags = set(re.findall(r"\b(amx_[a-z0-9_]+|avx512_bf16|avx512f|avx2)\b", text))
    return sorted(flags)


def fast_bf16(env: Optional[Mapping[str, str]] = None, cpuinfo: str = "/proc/cpuinfo",
              cuda: Optional[bool] = None) -> tuple[bool, str]:
    """(whether bf16 runs on hardware here, why in words)."""
    env = os.environ if env is None else env
    if cuda is None:
        import torch  # noqa: PLC0415 (config/ loads without torch; only the device query needs it)

        cuda = torch.cuda.is_available()
    if cuda:
        import torch  # noqa: PLC0415 (config/ loads without torch; only the device query needs it)

        if torch.cuda.is_bf16_supported():
            return True, f"CUDA device {torch.cuda.get_device_name()} supports bf16"
        return False, f"CUDA device {torch.cuda.get_device_name()} has no bf16 support"
    flags = cpu_bf16_flags(cpuinfo)
    have = [f for f in flags if f in _BF16_FLAGS]
    if not have:
        return False, f"this CPU has no bf16 instructions (flags: {', '.join(flags) or 'unknown'})"
    aten = env.get("ATEN_CPU_CAPABILITY", "").lower()
    if aten in ("default", "avx2", "avx"):
        return False, f"ATEN_CPU_CAPABILITY={aten} limits torch's kernels below AVX-512 (the CPU has {', '.join(have)})"
    onednn = env.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if onednn and onednn not in _ONEDNN_BF16_ISAS:
        return False, f"ONEDNN_MAX_CPU_ISA={onednn} limits oneDNN below its bf16 instructions (the CPU has {', '.join(have)})"
    return True, f"this CPU has {', '.join(have)}"


def default_precision(env: Optional[Mapping[str, str]] = None, cpuinfo: str = "/proc/cpuinfo",
                      cuda: Optional[bool] = None) -> tuple[str, str]:
    """("bf16" where bf16 runs on hardware, else "fp32"; why in words)."""
    ok, why = fast_bf16(env, cpuinfo, cuda)
    return ("bf16" if ok else "fp32"), why


if __name__ == "__main__":  # the main job's script: "bf16 <why>" or "fp32 <why>"
    print(*default_precision())

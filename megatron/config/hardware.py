"""What this machine computes fast: bf16 hardware or not, read from the CPU's flags (or CUDA); GPUs' bf16 peaks.

On a CPU with AVX-512 BF16 or AMX a bf16 matmul is several times faster than fp32; on one with AVX2
only (many AMD EPYC machines) bf16 is emulated and a training step several times slower than in fp32
(README.md: 5.0 s against 0.97 s per iteration of the main job, kernels limited to AVX2). ``fast_bf16``
says which, with the reason in words, so that the main job (``examples/pretrain_tiny_bloom_cpu.sh``) and
the benchmarks can pick and report the precision.

``ATEN_CPU_CAPABILITY`` (torch's kernels) and ``ONEDNN_MAX_CPU_ISA`` (oneDNN's matmuls) limiting
the instruction set below AVX-512 are honoured: with them a machine that has the instructions
behaves as one without, which is how the AVX2-only case is measured on a machine with AVX-512.

FP8 (``--fp8-format``): ``PEAK_FP8_TFLOPS`` (datasheet dense FP8 tensor-core peaks; the A100 has no FP8 tensor
cores), ``fp8_capability_problem`` (``torch._scaled_mm`` runs FP8 on CUDA capability 8.9 and newer) and
``check_fp8_device``, the startup check: that capability on CUDA, a tiny e4m3 ``torch._scaled_mm`` on CPU.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

__all__ = ["cpu_bf16_flags", "fast_bf16", "flex_compiles_on_this_cpu", "default_precision", "PEAK_BF16_TFLOPS",
           "PEAK_FP8_TFLOPS", "FP8_MIN_CAPABILITY", "fp8_capability_problem", "check_fp8_device"]

# Dense bf16 tensor-core peak per GPU, TFLOP/s (datasheet values, SXM parts; sparsity not counted): what MFU
# divides by (megatron.training.metrics) and what the planner's GPUs compute at (megatron.planner.specs).
PEAK_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}
# Dense FP8 tensor-core peak per GPU, TFLOP/s (datasheets, SXM parts, without sparsity): twice bf16's on Hopper.
# The A100 (Ampere, capability 8.0) has no FP8 tensor cores: no entry. What the planner's FP8 GEMMs run at.
PEAK_FP8_TFLOPS = {"H100": 1979.0, "H200": 1979.0}
# torch._scaled_mm's FP8 GEMMs need CUDA capability 8.9 (Ada) or newer: Hopper is 9.0, Ampere (A100) 8.0.
FP8_MIN_CAPABILITY = (8, 9)

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


def flex_compiles_on_this_cpu(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether inductor compiles flex attention for the CPU in this process: its C++ template needs AVX2 kernels
    (torch._inductor.kernel.flex.flex_cpu.check_cpu_supported: a CPU with AVX2 and ATEN_CPU_CAPABILITY other than
    ``default``; elsewhere it raises "torch.compile on current platform is not supported for CPU")."""
    import torch  # noqa: PLC0415 (config/ loads without torch; only the CPU query needs it)

    env = os.environ if env is None else env
    return torch.cpu._is_avx2_supported() and env.get("ATEN_CPU_CAPABILITY") != "default"


def default_precision(env: Optional[Mapping[str, str]] = None, cpuinfo: str = "/proc/cpuinfo",
                      cuda: Optional[bool] = None) -> tuple[str, str]:
    """("bf16" where bf16 runs on hardware, else "fp32"; why in words)."""
    ok, why = fast_bf16(env, cpuinfo, cuda)
    return ("bf16" if ok else "fp32"), why


def fp8_capability_problem(capability: tuple[int, int], device: str = "this GPU") -> Optional[str]:
    """Why ``--fp8-format`` cannot run on a CUDA device of ``capability`` (major, minor), or None where it can."""
    if tuple(capability) >= FP8_MIN_CAPABILITY:
        return None
    major, minor = capability
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    return (f"--fp8-format needs FP8 tensor cores: torch._scaled_mm runs FP8 GEMMs on CUDA capability {need} or "
            f"newer (Ada, Hopper), and {device} has capability {major}.{minor}, without FP8 tensor cores; drop "
            f"--fp8-format (train in bf16) or use H100 / H200 GPUs")


def check_fp8_device(cuda: Optional[bool] = None) -> None:
    """At startup of an FP8 run: ValueError where this device cannot run its GEMMs. On CUDA the device's
    capability (``fp8_capability_problem``); on CPU a tiny e4m3 ``torch._scaled_mm`` must run."""
    import torch  # noqa: PLC0415 (config/ loads without torch; only the device query needs it)

    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        problem = fp8_capability_problem(torch.cuda.get_device_capability(), torch.cuda.get_device_name())
        if problem:
            raise ValueError(problem)
        return
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32)
        out = torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16)
    except (RuntimeError, AttributeError, NotImplementedError) as error:
        raise ValueError(f"--fp8-format: torch._scaled_mm does not run on this CPU with torch {torch.__version__} "
                         f"({type(error).__name__}: {error}); drop --fp8-format or use a torch whose CPU "
                         f"backend has FP8 GEMMs (2.13 has)") from error
    if float(out[0, 0]) != 16.0:
        raise ValueError(f"--fp8-format: torch._scaled_mm on this CPU gave {float(out[0, 0])} for a 16-term sum "
                         f"of ones, not 16; drop --fp8-format")


if __name__ == "__main__":  # the main job's script: "bf16 <why>" or "fp32 <why>"
    print(*default_precision())

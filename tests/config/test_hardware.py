"""Which precision the main job picks: bf16 only where the CPU (or GPU) has bf16 instructions."""

from megatron.config.hardware import cpu_bf16_flags, default_precision, fast_bf16, flex_compiles_on_this_cpu

AMX = "processor : 0\nflags : fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
EPYC_AVX2 = "processor : 0\nflags : fpu sse avx avx2 fma\n"


def _cpuinfo(tmp_path, text):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return str(path)


def test_bf16_only_with_bf16_instructions(tmp_path):
    amx, avx2 = _cpuinfo(tmp_path, AMX), str(tmp_path / "epyc")
    open(avx2, "w").write(EPYC_AVX2)
    assert cpu_bf16_flags(amx) == ["amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f"]
    assert default_precision({}, amx, cuda=False) == ("bf16", "this CPU has amx_bf16, avx512_bf16")
    precision, why = default_precision({}, avx2, cuda=False)
    assert precision == "fp32" and "no bf16 instructions" in why and "avx2" in why
    assert fast_bf16({}, str(tmp_path / "missing"), cuda=False) == (False, "this CPU has no bf16 instructions "
                                                                          "(flags: unknown)")


def test_limits_on_the_instruction_set_are_honoured(tmp_path):
    amx = _cpuinfo(tmp_path, AMX)
    assert not fast_bf16({"ATEN_CPU_CAPABILITY": "avx2"}, amx, cuda=False)[0]
    assert not fast_bf16({"ONEDNN_MAX_CPU_ISA": "AVX2"}, amx, cuda=False)[0]
    assert fast_bf16({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "ATEN_CPU_CAPABILITY": "avx512"}, amx, cuda=False)[0]


def test_flex_compiles_on_this_cpu_is_inductors_own_check(monkeypatch):
    """Where flex attention's forward runs by blocks of SDPA (megatron.model.attention_core) is where inductor's
    CPU flex template refuses (a torch upgrade that changes its rule fails here, not in a user's run)."""
    from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

    for capability in (None, "default", "DEFAULT", "avx2"):
        if capability is None:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        assert flex_compiles_on_this_cpu() == check_cpu_supported(), capability

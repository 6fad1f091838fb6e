# Sourced by the CPU example scripts: sets PRECISION_FLAGS from PRECISION (auto, bf16 or fp32).
# auto is bf16 (DeepSpeed's BF16_Optimizer) where bf16 runs on hardware (AVX-512 BF16 / AMX, or a GPU) and
# fp32 where it has not (AVX2 only, where bf16 is emulated and about 17x slower); one line says which and why.
#
#   choose_precision PYTHON    (PRECISION read from the environment, default auto)
choose_precision() {
    local python=$1 why
    PRECISION=${PRECISION:-auto}
    if [ "$PRECISION" = auto ]; then
        read -r PRECISION why < <("$python" -m megatron.config.hardware)
        echo "precision: $PRECISION ($why; set PRECISION=bf16 or fp32 to choose)"
    fi
    case "$PRECISION" in
        bf16) PRECISION_FLAGS=(--bf16) ;;
        fp32) PRECISION_FLAGS=() ;;
        *) echo "PRECISION=$PRECISION: use auto, bf16 or fp32" >&2; exit 2 ;;
    esac
}

"""The FP8 quantizers and the scaled GEMM (megatron.parallel.fp8_quantize) against references written here from the
definitions: the e4m3 / e5m2 value grids decoded from their bit layouts (OCP 8-bit floating point), round to
nearest with ties to the even code, saturation at the largest finite value; the recipes' scale rules (per tensor
max / amax; blockwise: 1 x 128 and 128 x 128 blocks, power-of-two scales rounded down; MXFP8: 1 x 32 blocks, e8m0
scales 2^ceil(log2(amax / 448))); and torchao's float8 and MX quantizers where it has them (its RCEIL mode is
the e8m0 rule Transformer Engine and cuBLAS use). The GEMM is compared with the float64 product of the
dequantized operands: only the fp32 accumulation differs."""

import math

import pytest
import torch

from megatron.parallel.fp8_quantize import (
    amax,
    dequantize,
    quantize_blocks,
    quantize_tensor,
    scaled_mm,
    tensor_scale,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (exponent bits, mantissa bits, bias) of each format
LAYOUT = {E4M3: (4, 3, 7), E5M2: (5, 2, 15)}


def fp8_grid(dtype) -> list[tuple[float, int]]:
    """Every finite non-negative value of the format with its mantissa code, decoded from the bit layout:
    e4m3fn has no infinities (only S.1111.111 is NaN), e5m2 reserves the top exponent for inf / NaN."""
    e_bits, m_bits, bias = LAYOUT[dtype]
    out = []
    for exponent in range(2 ** e_bits):
        for mantissa in range(2 ** m_bits):
            if dtype == E4M3 and exponent == 15 and mantissa == 7:
                continue
            if dtype == E5M2 and exponent == 31:
                continue
            if exponent == 0:  # subnormal
                value = mantissa / 2 ** m_bits * 2.0 ** (1 - bias)
            else:
                value = (1 + mantissa / 2 ** m_bits) * 2.0 ** (exponent - bias)
            out.append((value, mantissa))
    return sorted(out)


def round_to_grid(values: torch.Tensor, dtype) -> torch.Tensor:
    """Round to the nearest value of the format (ties to the even mantissa code), saturating at the largest."""
    grid = fp8_grid(dtype)
    top = grid[-1][0]
    out = []
    for v in values.double().flatten().tolist():
        magnitude = min(abs(v), top)
        best = min(grid, key=lambda g: (abs(g[0] - magnitude), g[1] % 2))
        out.append(math.copysign(best[0], v))
    return torch.tensor(out, dtype=torch.float64).reshape(values.shape)


def test_the_grids_have_the_formats_largest_values():
    assert fp8_grid(E4M3)[-1][0] == 448.0 and fp8_grid(E5M2)[-1][0] == 57344.0
    assert len(fp8_grid(E4M3)) == 127 and len(fp8_grid(E5M2)) == 124  # 0, then 126 / 123 positive codes


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_per_tensor_quantization_rounds_and_saturates_as_the_format_defines(dtype):
    torch.manual_seed(0)
    x = torch.randn(16, 24) * 3
    x[0, 0], x[1, 1] = 1e6, -1e6  # far beyond the range at any scale below: saturate, never inf or NaN
    scale = torch.tensor(fp8_grid(dtype)[-1][0] / 5.0)
    q = quantize_tensor(x, scale, dtype)
    expected = round_to_grid(x.double() * scale.double(), dtype)
    assert torch.equal(q.data.double(), expected)
    assert q.data[0, 0].float() == fp8_grid(dtype)[-1][0] and q.data[1, 1].float() == -fp8_grid(dtype)[-1][0]
    assert q.scale_inv.item() == pytest.approx(1 / scale.item(), rel=1e-7)


def test_tensor_scale_is_max_over_amax_with_the_margin():
    assert tensor_scale(torch.tensor(2.0), E4M3).item() == 224.0
    assert tensor_scale(torch.tensor(2.0), E4M3, margin=2).item() == 56.0
    assert tensor_scale(torch.tensor(8.0), E5M2).item() == 7168.0
    for unusable in (0.0, float("inf"), float("nan")):  # an all-zero or overflowed tensor: scale 1
        assert tensor_scale(torch.tensor(unusable), E4M3).item() == 1.0


def test_per_tensor_scale_and_cast_equal_torchaos():
    pytest.importorskip("torchao")
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    torch.manual_seed(1)
    x = torch.randn(64, 96) * 7
    for dtype in (E4M3, E5M2):
        ours = tensor_scale(amax(x), dtype)
        theirs = tensor_to_scale(x.abs().amax(), dtype)
        assert torch.allclose(ours, theirs.float(), rtol=1e-6)
        q = quantize_tensor(x, ours, dtype)
        assert torch.equal(q.data, to_fp8_saturated(x.float() * ours, dtype))


def _blockwise_reference(x: torch.Tensor, block: tuple[int, int]):
    """Each block (partial at the edges) scaled by 2^floor(log2(448 / amax)), rounded to e4m3."""
    rows, k = x.shape
    br, bk = block
    data = torch.zeros(rows, k, dtype=torch.float64)
    scale_inv = torch.zeros(math.ceil(rows / br), math.ceil(k / bk), dtype=torch.float64)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            part = x[i * br:(i + 1) * br, j * bk:(j + 1) * bk].double()
            block_amax = part.abs().max().item()
            scale = 2.0 ** math.floor(math.log2(448.0 / block_amax)) if block_amax > 0 else 1.0
            scale_inv[i, j] = 1 / scale
            data[i * br:(i + 1) * br, j * bk:(j + 1) * bk] = round_to_grid(part * scale, E4M3)
    return data, scale_inv


@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128 activations", "128x128 weights"])
def test_blockwise_quantization_equals_the_recipe(block):
    torch.manual_seed(2)
    x = torch.randn(130, 200) * torch.logspace(-3, 2, 200)  # columns of very different size; partial edge blocks
    x[5, :128] = 0.0  # an all-zero 1 x 128 block: scale 1
    q = quantize_blocks(x, block, E4M3)
    data, scale_inv = _blockwise_reference(x, block)
    assert q.scale_inv.shape == (math.ceil(130 / block[0]), 2)
    assert torch.equal(q.scale_inv.double(), scale_inv)
    assert torch.equal(q.data.double(), data)
    assert (torch.log2(q.scale_inv) == torch.round(torch.log2(q.scale_inv))).all()  # powers of two


def test_mxfp8_quantization_equals_the_e8m0_rule_and_torchaos():
    torch.manual_seed(3)
    x = torch.randn(8, 96) * torch.logspace(-4, 3, 96)
    x[0, :32] = 0.0
    x[1, 0] = 448.0 * 2 ** 5  # amax / 448 an exact power of two: the exponent is exactly 5
    q = quantize_blocks(x, (1, 32), E4M3, mx=True)
    for i in range(8):
        for j in range(3):
            part = x[i, 32 * j:32 * (j + 1)].double()
            block_amax = part.abs().max().item()
            if block_amax == 0:
                expected_exponent = 0
            else:
                mantissa, exponent = math.frexp(block_amax / 448.0)  # = mantissa * 2^exponent, mantissa in [0.5, 1)
                expected_exponent = exponent - 1 if mantissa == 0.5 else exponent  # ceil(log2(.))
            assert q.scale_inv[i, j].item() == 2.0 ** expected_exponent, (i, j)
            assert torch.equal(q.data[i, 32 * j:32 * (j + 1)].double(),
                               round_to_grid(part / 2.0 ** expected_exponent, E4M3))
    assert q.scale_inv[1, 0].item() == 2.0 ** 5
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    y = x[1:]  # torchao's e8m0 of an all-zero block is its smallest scale, not 1: compare the other rows
    q = quantize_blocks(y, (1, 32), E4M3, mx=True)
    scale, data = to_mx(y, E4M3, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    assert torch.equal(q.scale_inv, scale.float().reshape(q.scale_inv.shape))
    assert torch.equal(q.data, data)


@pytest.mark.parametrize("recipe", ["tensor", "blockwise", "mxfp8"])
def test_scaled_mm_is_the_product_of_the_dequantized_operands(recipe):
    torch.manual_seed(4)
    a, b = torch.randn(48, 200), torch.randn(40, 200) * 0.01
    if recipe == "tensor":
        qa = quantize_tensor(a, tensor_scale(amax(a), E4M3), E4M3)
        qb = quantize_tensor(b, tensor_scale(amax(b), E5M2), E5M2)
    elif recipe == "blockwise":
        qa, qb = quantize_blocks(a, (1, 128), E4M3), quantize_blocks(b, (128, 128), E4M3)
    else:
        qa, qb = quantize_blocks(a, (1, 32), E4M3, mx=True), quantize_blocks(b, (1, 32), E4M3, mx=True)
    expected = dequantize(qa).double() @ dequantize(qb).double().t()
    out = scaled_mm(qa, qb, torch.float32)
    # fp32 accumulation of 200 products: a few fp32 ulps of the largest partial sums
    bound = 200 * 2 ** -24 * (dequantize(qa).abs().double() @ dequantize(qb).abs().double().t())
    assert ((out.double() - expected).abs() <= bound + 1e-30).all()
    # and close to the unquantized product (FP8 really ran: not equal to it)
    full = a.double() @ b.double().t()
    assert not torch.equal(out.double(), full)
    assert (out.double() - full).norm() / full.norm() < 0.1

"""megatron.testing.tolerance's bound and the report of how close the suite's tolerances come."""

import math

import pytest
import torch

from megatron.testing.tolerance import model_tolerance, tolerance, transformer_depth
from megatron.testing.tolerance_report import margins, parse, record
from tests.helpers.model import tiny_config


def test_the_bound_is_the_random_walk_of_both_roundings():
    fp32, bf16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert tolerance(torch.float32, 4, 64) == pytest.approx(2 * fp32 + 16 * fp32)
    # bf16 rounds each result to 8 bits but sums in fp32: the first term dominates.
    assert tolerance(torch.bfloat16, 4, 64, scale=3.0) == pytest.approx(3.0 * (2 * bf16 + 16 * fp32))
    assert tolerance(torch.float64, 1, 1, accumulate=torch.float32) == pytest.approx(2 * torch.finfo(torch.float64).eps)
    assert transformer_depth(2) == 27
    with pytest.raises(ValueError, match="depth and width must be positive"):
        tolerance(torch.float32, 0, 64)


def test_a_models_tolerance_grows_with_its_depth_width_and_logits():
    logits = torch.tensor([-8.0, 2.0])
    shallow, deep = tiny_config(), tiny_config(num_layers=8)
    assert model_tolerance(deep, torch.float32, logits) > model_tolerance(shallow, torch.float32, logits)
    assert model_tolerance(shallow, torch.float32, 2 * logits) == pytest.approx(
        2 * model_tolerance(shallow, torch.float32, logits))
    assert model_tolerance(shallow, torch.float32, logits) == pytest.approx(tolerance(torch.float32, 27, 256, 8.0))


def test_the_report_reads_pytests_explanations_of_tolerance_comparisons(tmp_path):
    assert parse("9.9e-07 <= 0.0002\n +  where 0.0002 = tol(2.0)") == (9.9e-07, 0.0002)
    assert parse("1e-07 <= (1e-05 * 6.25)\n +  where ...") == (1e-07, pytest.approx(6.25e-05))
    assert parse("0.0 < 1e-05") == (0.0, 1e-05)
    for other in ("3 == 3", "12 <= 18", "(0.5 < 1e-06 or True)", "x < __import__('os')"):
        assert parse(other) is None, other
    path = str(tmp_path / "report.jsonl")
    record(path, "t::a", "here", "2e-06 < 1e-05")
    record(path, "t::b", "here", "5e-06 < 1e-05")
    record(path, "t::c", "there", "0.0 <= 1e-05")
    record(path, "t::d", "there", "4 == 4")
    (kind,) = {k for v in margins([path]).values() for k in v}
    assert margins([path]) == {"here": {kind: pytest.approx(2.0)}, "there": {kind: math.inf}}

"""Megatron-LM's MoE flags as its Mixtral and DeepSeek-V3 launch scripts pass them: the load-balancing types (one
coefficient each) reach MoEConfig, the kernel choices are accepted with one startup warning each, and what does not
run here (Sinkhorn, the global aux loss, the DeepEP dispatcher, random routing) is refused
by name before launch."""

import pytest

from megatron.arguments import run_config_from_argv
from tests.helpers.arguments import tiny_config_argv

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


def _run(files, extra, world_size=1):
    return run_config_from_argv(tiny_config_argv(files) + MOE + extra, world_size=world_size, with_vocab=False)


@pytest.mark.parametrize("extra,aux,seq", [
    ([], 0.0, 0.0),
    (["--moe-aux-loss-coeff", "0.01"], 0.01, 0.0),
    (["--moe-loss-coeff", "0.01"], 0.01, 0.0),  # Megatron-DeepSpeed's spelling
    (["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"], 0.01, 0.0),
    (["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4"], 0.0, 1e-4),
    (["--moe-router-load-balancing-type", "seq_aux_loss", "aux_loss", "--moe-aux-loss-coeff", "1e-4", "0.01"],
     0.01, 1e-4),
    (["--moe-router-load-balancing-type", "none"], 0.0, 0.0),
])
def test_load_balancing_types_give_their_coefficients(files, extra, aux, seq):
    moe = _run(files, extra).model.moe
    assert (moe.aux_loss_coeff, moe.seq_aux_loss_coeff) == (aux, seq)


@pytest.mark.parametrize("dtype", [None, "fp32", "fp64"])
def test_router_dtype_reaches_the_config(files, dtype):
    assert _run(files, [] if dtype is None else ["--moe-router-dtype", dtype]).model.moe.router_dtype == dtype


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_token_dispatcher_types_reach_the_config(files, dispatcher):
    assert _run(files, ["--moe-token-dispatcher-type", dispatcher]).model.moe.token_dispatcher_type == dispatcher
    assert _run(files, []).model.moe.token_dispatcher_type == "alltoall"


def test_a_coefficient_given_to_none_is_reported_unused(files):
    rc = _run(files, ["--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.01"])
    assert rc.model.moe.aux_loss_coeff == 0.0
    assert rc.startup_warnings == ("--moe-aux-loss-coeff 0.01 has no effect with --moe-router-load-balancing-type "
                                   "none (no balancing loss)",)


def test_kernel_choices_are_accepted_with_one_warning_each(files):
    rc = _run(files, ["--moe-grouped-gemm", "--moe-permute-fusion", "--moe-token-dispatcher-type", "alltoall"])
    assert len(rc.startup_warnings) == 2
    assert rc.startup_warnings[0].startswith("--moe-grouped-gemm has no effect here: each rank's experts always run")
    assert rc.startup_warnings[1].startswith("--moe-permute-fusion has no effect here: tokens are permuted")
    assert rc.model.moe == _run(files, []).model.moe


def test_the_flex_dispatcher_runs_as_alltoall_with_one_line(files):
    """Megatron-LM's flex dispatcher (DeepEP / HybridEP kernels) moves the same tokens as alltoall: the same MoE
    config as --moe-token-dispatcher-type alltoall, with one startup line for it and one for its backend flag."""
    rc = _run(files, ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"])
    assert rc.model.moe == _run(files, ["--moe-token-dispatcher-type", "alltoall"]).model.moe
    assert rc.model.moe.token_dispatcher_type == "alltoall"
    assert [w.split(" (")[0].split(" has")[0] for w in rc.startup_warnings] == \
        ["--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend deepep"], rc.startup_warnings


@pytest.mark.parametrize("extra,message", [
    (["--moe-router-load-balancing-type", "sinkhorn"], "sinkhorn: S-BASE's Sinkhorn routing is not implemented"),
    (["--moe-router-load-balancing-type", "aux_loss", "global_aux_loss", "--moe-aux-loss-coeff", "0.01", "0.01"],
     "global_aux_loss: the global-batch aux loss is not implemented"),
    (["--moe-router-load-balancing-type", "quantile_balancing"], "quantile balancing is not implemented"),
    (["--moe-router-load-balancing-type", "seq_aux_loss", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
     "--moe-aux-loss-coeff gives 1 coefficient\\(s\\) for 2 --moe-router-load-balancing-type"),
    (["--moe-router-load-balancing-type", "aux_loss", "aux_loss", "--moe-aux-loss-coeff", "0.01", "0.01"],
     "names a type twice"),
])
def test_what_does_not_run_here_is_refused_before_launch(files, extra, message):
    with pytest.raises(ValueError, match=message):
        _run(files, extra)


def test_force_load_balancing_reaches_the_config(files):
    assert _run(files, ["--moe-router-force-load-balancing"]).model.moe.router_force_load_balancing
    assert not _run(files, []).model.moe.router_force_load_balancing


def test_the_overlap_flags_reach_the_config(files):
    moe = _run(files, ["--overlap-moe-expert-parallel-comm", "--moe-shared-expert-overlap",
                       "--moe-shared-expert-intermediate-size", "32", "--expert-model-parallel-size", "2"],
               world_size=2).model.moe
    assert (moe.overlap_expert_parallel_comm, moe.shared_expert_overlap) == (True, True)
    moe = _run(files, []).model.moe
    assert (moe.overlap_expert_parallel_comm, moe.shared_expert_overlap) == (False, False)


@pytest.mark.parametrize("extra,message", [
    (["--overlap-moe-expert-parallel-comm"], "--expert-model-parallel-size is 1 \\(no exchange\\)"),
    (["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
      "allgather"], "use --moe-token-dispatcher-type alltoall \\(not allgather\\)"),
    (["--moe-shared-expert-overlap"], "--moe-shared-expert-overlap runs the shared expert .* there is none"),
])
def test_overlap_flags_without_what_they_overlap_are_refused(files, extra, message):
    with pytest.raises(ValueError, match=message):
        _run(files, extra, world_size=2)

"""GPTModel at TP=2 and TP=4 equals TP=1: initial weights, logits, loss and every gradient.

One launch per TP size. Each rank builds the TP model and, beside it, the TP=1 model (no groups)
from the same config; gathered shards must equal the single-process tensors: the initial weights exactly (slices
of the same full weights), the rest within the tolerance of the model's depth (megatron.testing.tolerance): TP
splits the row-parallel products' sums and the cross entropy's over the ranks.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.model import GPTModel
from megatron.parallel.replicated import sync_tp_duplicated_parameters, tp_duplicated_parameters
from megatron.parallel.state import ParallelState
from megatron.testing import run_distributed
from megatron.testing.tolerance import model_tolerance, step_depth, tolerance
from tests.helpers.model import POSITION_TYPES, tiny_config


def _all_gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (plain list all_gather, no autograd)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gather(tensor: torch.Tensor, param, group) -> torch.Tensor:
    """The full tensor of a parameter (or its gradient) sharded along its partition_dim."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    return _all_gather(tensor, param.partition_dim, group)


def _max_diffs(model, reference, group, attribute):
    """{name: (max |gathered model tensor - reference tensor|, max |reference tensor|)} for attribute 'data' or
    'grad'."""
    ref_params = dict(reference.named_parameters())
    diffs = {}
    for name, param in model.named_parameters():
        full, expected = _gather(getattr(param, attribute), param, group), getattr(ref_params[name], attribute)
        diffs[name] = ((full - expected).abs().max().item(), expected.abs().max().item())
    return diffs


# Llama-style: RMSNorm, SwiGLU, grouped-query attention (2 key / value heads: whole groups at TP 2), no
# biases, an untied head. Under the key "llama" beside the position types.
LLAMA = dict(position_embedding_type="rotary", normalization="rmsnorm", swiglu=True, num_key_value_heads=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=96)
# Qwen3's attention: Llama's with every query / key head RMS-normed (--qk-layernorm). Each TP rank holds other
# heads, so those norms' weight gradients must be summed over the TP group to equal the single process's.
VARIANTS = {"llama": LLAMA, "qwen3": dict(LLAMA, qk_layernorm=True)}


def _compare_one(position_type, state):
    fields = VARIANTS.get(position_type) or dict(position_embedding_type=position_type, embed_layernorm=True)
    config = tiny_config(num_attention_heads=4, **fields)
    model, reference = GPTModel(config, state), GPTModel(config, ParallelState.single())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
    mask = (torch.rand(2, 16, generator=torch.Generator().manual_seed(7)) > 0.2).float()
    out = {"init": max(diff for diff, _ in _max_diffs(model, reference, state.tp_group, "data").values())}

    logits = model(ids)  # [s, b, vp]
    assert logits.shape == (16, 2, 256 // state.tp_size)
    gathered = _all_gather(logits, -1, state.tp_group)  # [s, b, v]
    expected = reference(ids)
    out["logits"] = (gathered - expected).abs().max().item()
    out["logits_bound"] = model_tolerance(config, torch.float32, expected)

    loss, ref_loss = model(ids, labels=labels, loss_mask=mask), reference(ids, labels=labels, loss_mask=mask)
    loss.backward()
    ref_loss.backward()
    out["loss"] = abs(loss.item() - ref_loss.item())
    # A token's loss moves by at most twice its logits' difference; the cross entropy's own shift, exp, sum over
    # the vocabulary and log, and the masked mean's product, sum and division (depth 7) add theirs.
    out["loss_bound"] = 2 * out["logits_bound"] + tolerance(torch.float32, 7, 256, ref_loss.item())
    out["grads"] = _max_diffs(model, reference, state.tp_group, "grad")
    # A gradient: the forward's roundings, one product back through each, the weight gradient's own; its
    # longest sum over the MLP's width or the 32 tokens; on the scale of that parameter's gradient.
    out["grad_depth"], out["grad_width"] = step_depth(config.num_layers), max(config.ffn_size, ids.numel())
    out["grad_scale"] = max(p.grad.abs().max().item() for p in reference.parameters())
    if position_type == "alibi":
        out["slopes"] = model.layers[0].self_attention.alibi_slopes.tolist()
    return out


def _check_sync(state):
    """Perturb the replicated parameters by the TP rank; sync must restore the mean everywhere."""
    model = GPTModel(tiny_config(embed_layernorm=True), state)
    replicated = [p for _, p in tp_duplicated_parameters(model)]
    sharded_before = [p.detach().clone() for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
    with torch.no_grad():
        for p in replicated:
            p.add_(float(state.tp_rank))
    count = sync_tp_duplicated_parameters(model, state.tp_group)
    expected_shift = (state.tp_size - 1) / 2.0
    reference = GPTModel(tiny_config(embed_layernorm=True), ParallelState.single())
    ref = {n: p for n, p in reference.named_parameters()}
    shift_error = max((p - ref[n] - expected_shift).abs().max().item() for n, p in tp_duplicated_parameters(model))
    # p + rank, the all-reduce's sum over the TP ranks, the division by their number, the check's subtractions:
    # depth 4, summing tp terms, on numbers up to max |p| + tp.
    scale = max(p.abs().max().item() for _, p in tp_duplicated_parameters(model)) + state.tp_size
    sharded_after = [p for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
    unchanged = all(torch.equal(a, b) for a, b in zip(sharded_before, sharded_after))
    return {"count": count, "num_replicated": len(replicated), "shift_error": shift_error,
            "shift_bound": tolerance(torch.float32, 4, state.tp_size, scale), "sharded_unchanged": unchanged}


def _run(rank, world_size):
    # A forked child must not enter the OpenMP pool it inherited from a parent that already used
    # it (libgomp then waits for threads that do not exist): one intra-op thread per rank.
    torch.set_num_threads(1)
    state = ParallelState.create(tp=world_size, pp=1)
    try:
        results = {pt: _compare_one(pt, state) for pt in POSITION_TYPES}
        if state.tp_size <= 2:  # 2 key / value heads
            results.update({variant: _compare_one(variant, state) for variant in VARIANTS})
        results["sync"] = _check_sync(state)
        return results
    finally:
        state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_model_equals_single_process(tp_size):
    from megatron.model.positional import alibi_slopes

    results = run_distributed(_run, world_size=tp_size)
    per_rank = 4 // tp_size
    for rank, result in enumerate(results):
        for position_type in POSITION_TYPES + (tuple(VARIANTS) if tp_size <= 2 else ()):
            out = result[position_type]
            where = f"rank {rank}, {position_type}"
            assert out["init"] == 0.0, where  # the same full weights, sliced
            assert out["logits"] <= out["logits_bound"], (where, out["logits"])
            assert out["loss"] <= out["loss_bound"], (where, out["loss"])
            assert len(out["grads"]) >= 15 and out["grad_scale"] > 1e-3, where
            for name, (diff, scale) in out["grads"].items():
                bound = tolerance(torch.float32, out["grad_depth"], out["grad_width"], scale)
                assert diff <= bound, (where, name, diff, scale)
        # Exact: the rank's slice of the same float64 slopes, cast to fp32.
        expected_slopes = torch.tensor(alibi_slopes(4), dtype=torch.float32)[rank * per_rank:(rank + 1) * per_rank]
        assert result["alibi"]["slopes"] == expected_slopes.tolist(), rank
        sync = result["sync"]
        assert sync["count"] == sync["num_replicated"] > 0, (rank, sync)
        assert sync["shift_error"] <= sync["shift_bound"], (rank, sync)
        assert sync["sharded_unchanged"], rank

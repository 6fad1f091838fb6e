"""Multi-head latent attention against transformers' DeepseekV3Attention (the independent reference: eager
matmuls, its own interleaved rotary), with and without a query latent, at TP=1, TP=2, TP=2 with sequence
parallelism (each rank its S/2 tokens), CP=2 (ring attention, each rank its load-balanced tokens) and
DeepSpeed-Ulysses SP=2 (heads exchanged by all-to-all, each rank its S/2 tokens) in one launch: the output and
the gradient of the input and of every weight (shards against the slices of transformers' full ones; the weight
gradients of the token-split layouts summed over their ranks, as training does), within the tolerance of the
attention's depth in fp32 (megatron.testing.tolerance). Plus what MLA refuses before launch and its ZB-H1
weight-gradient deferral.
"""

import dataclasses

import pytest
import torch

from megatron.checkpoint.hf.deepseek import MLA_NAMES
from megatron.config.mla import MLAConfig
from megatron.parallel.state import ParallelState
from megatron.testing import run_distributed
from megatron.testing.tolerance import tolerance
from tests.helpers.model import tiny_config

MLA = MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)
S, B = 12, 2
# The roundings from the input to the output: the query's down product, its RMSNorm, its up product, the
# rotary's product and sum, Q.K^T, the scaling, softmax's exp and normalization, probabilities x V, the output
# product; the longest sum is over the hidden size (64).
DEPTH, WIDTH = 11, 64


def _hf_attention(q_lora_rank):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                           q_lora_rank=q_lora_rank,
                                           kv_lora_rank=MLA.kv_lora_rank, qk_nope_head_dim=MLA.qk_head_dim,
                                           qk_rope_head_dim=MLA.qk_pos_emb_head_dim, v_head_dim=MLA.v_head_dim,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    torch.manual_seed(11)
    attention = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for param in attention.parameters():  # norms start at 1: perturb every tensor, so a misplaced one shows
            param.copy_(torch.randn_like(param) * (0.3 if param.dim() == 1 else 0.15) + (param.dim() == 1))
    return attention, DeepseekV3RotaryEmbedding(config)


def _hf_forward(attention, rotary, x):
    """x [b, s, h] -> transformers' output [b, s, h] (causal)."""
    positions = torch.arange(S)[None]
    mask = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]
    out, _ = attention(x, position_embeddings=rotary(x, positions), attention_mask=mask)
    return out


def _our_attention(q_lora_rank, tp_group, hf_attention, sequence_parallel=False, cp_group=None, exchange=None):
    from megatron.model.latent_attention import MultiLatentAttention
    from megatron.parallel.state import LayerGroups, group_rank, group_size

    config = tiny_config(position_embedding_type="rotary", normalization="rmsnorm", swiglu=True,
                         add_bias_linear=False, qk_layernorm=True, layernorm_epsilon=1e-6,
                         mla=dataclasses.replace(MLA, q_lora_rank=q_lora_rank), sequence_parallel=sequence_parallel)
    ours = MultiLatentAttention(config, LayerGroups(tp=tp_group, cp=cp_group, sequence_exchange=exchange))
    rank, tp = group_rank(tp_group), group_size(tp_group)
    theirs = dict(hf_attention.named_parameters())
    pairs = [(mine, theirs[hf]) for mine, hf in MLA_NAMES + (("dense.weight", "o_proj.weight"),) if hf in theirs]
    with torch.no_grad():
        for mine, full in pairs:
            param = ours.get_parameter(mine)
            param.copy_(_shard(full, param, rank, tp))
    assert len(pairs) == len(list(ours.parameters())), [n for n, _ in ours.named_parameters()]
    return ours, pairs


def _shard(full, param, rank, tp):
    """This TP rank's part of a full tensor (the parameter's own partition dim), or the whole one if replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(tp, dim=param.partition_dim)[rank]


def _compare(q_lora_rank, tp_group, sequence_parallel=False, cp_group=None, ulysses_group=None):
    """Ours against transformers' on the same input; with ``sequence_parallel`` this TP rank holds tokens
    rank * S/tp .. of the input and output, with ``cp_group`` the CP rank's load-balanced tokens, with
    ``ulysses_group`` (DeepSpeed-Ulysses) tokens rank * S/sp .. (each then compared with those tokens of
    transformers' whole-sequence results)."""
    import functools

    from megatron.engine.ulysses import distributed_attention
    from megatron.model.attention import SequenceExchange
    from megatron.parallel.context_parallel import load_balanced_positions
    from megatron.parallel.state import group_rank, group_size

    exchange = None
    if ulysses_group is not None:
        exchange = SequenceExchange(group_rank(ulysses_group), group_size(ulysses_group),
                                    functools.partial(distributed_attention, ulysses_group))
    hf_attention, rotary = _hf_attention(q_lora_rank)
    ours, pairs = _our_attention(q_lora_rank, tp_group, hf_attention, sequence_parallel, cp_group, exchange)
    x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(4))
    rank, tp = group_rank(tp_group), group_size(tp_group)
    mine = torch.arange(S)  # the tokens this rank holds
    if sequence_parallel:
        mine = mine.chunk(tp)[rank]
    if cp_group is not None:
        mine = load_balanced_positions(S, group_size(cp_group), group_rank(cp_group))
    if ulysses_group is not None:
        mine = mine.chunk(group_size(ulysses_group))[group_rank(ulysses_group)]
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1)[mine].clone().requires_grad_()
    expected = _hf_forward(hf_attention, rotary, x_hf)
    got = ours(x_ours).transpose(0, 1)  # [b, s, h] (this rank's tokens)
    (expected * weight).sum().backward()
    (got * weight[:, mine]).sum().backward()
    grads = {}  # name -> (the largest difference, the largest of transformers' gradient)
    for name, full in pairs:
        for group in (cp_group, ulysses_group):  # each rank's part of the weight gradient (training sums them)
            if group is not None:
                torch.distributed.all_reduce(ours.get_parameter(name).grad, group=group)
        theirs = _shard(full.grad, ours.get_parameter(name), rank, tp)
        grads[name] = ((ours.get_parameter(name).grad - theirs).abs().max().item(), theirs.abs().max().item())
    return {"output": (got - expected[:, mine]).abs().max().item(), "scale": expected.abs().max().item(),
            "input_grad": (x_ours.grad.transpose(0, 1) - x_hf.grad[:, mine]).abs().max().item(),
            "input_grad_scale": x_hf.grad.abs().max().item(), "grads": grads}


def _run(rank, world_size):
    """(q_lora_rank, layout) -> the differences: TP=1, TP=2, TP=2 with sequence parallelism, CP=2, Ulysses SP=2."""
    from megatron.engine.initialize import init_deepspeed_comm

    torch.set_num_threads(1)
    init_deepspeed_comm("gloo")  # Ulysses' all-to-all is DeepSpeed's
    state = ParallelState.create(tp=world_size, pp=1)
    group = state.tp_group  # both ranks: the TP group, or as the CP group of the CP=2 case
    try:
        return {(q_lora, name): _compare(q_lora, *case) for q_lora in (32, None) for name, case in (
            ("TP 1", (None,)), ("TP 2", (group,)), ("TP 2 SP", (group, True)), ("CP 2", (None, False, group)),
            ("Ulysses SP 2", (None, False, None, group)))}
    finally:
        state.destroy()


@pytest.mark.multiprocess
def test_mla_equals_transformers_deepseek_v3_attention_at_tp_sp_cp_and_ulysses():
    results = run_distributed(_run, world_size=2, timeout=240)
    for rank, result in enumerate(results):
        assert len(result) == 10, sorted(result)
        for (q_lora, name), out in result.items():
            where = f"rank {rank}, q_lora_rank {q_lora}, {name}"
            assert out["scale"] > 0.1, where
            assert out["output"] <= tolerance(torch.float32, DEPTH, WIDTH, out["scale"]), (where, out["output"])
            # Gradients: one product back through each forward operation and the weight gradient's own, summing
            # over the hidden size or the B x S = 24 tokens.
            grad_depth = 2 * DEPTH + 1
            input_grad_bound = tolerance(torch.float32, grad_depth, WIDTH, out["input_grad_scale"])
            assert out["input_grad"] <= input_grad_bound, (where, out["input_grad"])
            assert len(out["grads"]) == (7 if q_lora else 5), (where, sorted(out["grads"]))
            for name, (diff, scale) in out["grads"].items():
                assert diff <= tolerance(torch.float32, grad_depth, WIDTH, scale), (where, name, diff, scale)


def test_mla_refuses_what_it_does_not_implement():
    mla = dict(position_embedding_type="rotary", add_bias_linear=False, mla=MLA)
    with pytest.raises(ValueError, match="--multi-latent-attention is not implemented with --position-embedding-type "
                                         "alibi"):
        tiny_config(**dict(mla, position_embedding_type="alibi"))
    with pytest.raises(ValueError, match="--num-key-value-heads"):
        tiny_config(**mla, num_key_value_heads=2)
    with pytest.raises(ValueError, match="--qk-pos-emb-head-dim 7 must be even"):
        tiny_config(**dict(mla, mla=dataclasses.replace(MLA, qk_pos_emb_head_dim=7)))
    from megatron.inference.batching import BatchRunner
    from megatron.model import GPTModel

    with pytest.raises(ValueError, match="--multi-latent-attention has no batched KV cache: the inference server"):
        BatchRunner(GPTModel(tiny_config(**mla, normalization="rmsnorm", swiglu=True)), 256)


def test_zbh1_defers_the_replicated_down_projections_weight_gradients():
    """Under ZB-H1 (a WeightGradStore) the replicated W_qA and W_kvA defer their weight products like the parallel
    linears: after the backward pass they hold no gradient, after the W pass every weight gradient is autograd's."""
    from megatron.model.latent_attention import MultiLatentAttention, ReplicatedLinear
    from megatron.parallel.weight_grad_store import WeightGradStore, defer_weight_grads

    config = tiny_config(position_embedding_type="rotary", normalization="rmsnorm", swiglu=True,
                         add_bias_linear=False, qk_layernorm=True, mla=MLA)
    plain, split = MultiLatentAttention(config), MultiLatentAttention(config)
    split.load_state_dict(plain.state_dict())
    store = WeightGradStore()
    assert defer_weight_grads(split, store) == 5  # W_qA, W_kvA, W_qB, W_kvB, W_o
    x = torch.randn(S, B, 64, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(S, B, 64, generator=torch.Generator().manual_seed(4))
    (plain(x) * weight).sum().backward()
    (split(x) * weight).sum().backward()
    store.close_micro_batch()
    replicated = [m for m in split.modules() if isinstance(m, ReplicatedLinear)]
    assert len(replicated) == 2 and all(m.weight.grad is None for m in replicated)
    store.run_oldest()
    store.assert_empty()
    for (name, p), q in zip(plain.named_parameters(), split.parameters(), strict=True):
        scale = p.grad.abs().max().item()
        assert (q.grad - p.grad).abs().max().item() <= tolerance(torch.float32, 2 * DEPTH + 1, WIDTH, scale), name

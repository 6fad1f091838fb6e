"""--attention-backend flex (and unfused) equals the SDPA path: outputs and gradients of a whole GPTModel (ALiBi,
learned positions, a Llama-style rotary + GQA block, multi-head latent attention with value heads narrower than
its query / key heads), within the tolerance of the model's depth in its dtype (fp32 and bf16;
megatron.testing.tolerance), at TP=1 and TP=2 (each rank its own ALiBi slopes); incremental decoding with a KV
cache still equals the full forward (MLA's too); auto keeps SDPA on CPU; flash and flex refuse what they cannot
run. torch.compile makes each new shape cost seconds: the configurations are few and tiny."""

import math

import pytest
import torch

import megatron.model.attention_core as attention_core
from megatron.config.mla import MLAConfig
from megatron.model import GPTModel
from megatron.model.attention import KVCache, SelfAttention
from megatron.model.attention_core import resolve_attention_backend
from megatron.parallel.state import ParallelState
from megatron.testing import run_distributed
from megatron.testing.tolerance import model_tolerance, step_depth, tolerance
from tests.helpers.model import tiny_config

SEQ = 48  # three blocks of the CPU backward below: the blockwise gradients are stitched, not one block
LLAMA = dict(position_embedding_type="rotary", normalization="rmsnorm", swiglu=True, num_key_value_heads=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=96)
# multi-head latent attention (DeepSeek-V3's): value heads (12) narrower than the query / key heads (16 + 8)
MLA = dict(LLAMA, num_key_value_heads=None, qk_layernorm=True,
           mla=MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12))
CONFIGS = {"alibi": dict(position_embedding_type="alibi", embed_layernorm=True),
           "absolute": dict(position_embedding_type="absolute"), "llama": LLAMA, "mla": MLA}


def _loss_and_grads(config, state):
    model = GPTModel(config, state)
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = model(ids)  # [s, b, vp]
    model(ids, labels=labels, loss_mask=torch.ones(2, SEQ)).backward()
    return logits.float(), {name: p.grad.float() for name, p in model.named_parameters()}


def _config(position, params_dtype, backend):
    return tiny_config(attention_backend=backend, **CONFIGS[position], seq_length=SEQ, params_dtype=params_dtype)


def _max_diffs(position, params_dtype, state, backend="flex"):
    """(the largest logit difference, the largest gradient difference relative to its parameter's largest SDPA
    gradient, the tolerances of both: megatron.testing.tolerance)."""
    sdpa_logits, sdpa_grads = _loss_and_grads(_config(position, params_dtype, "sdpa"), state)
    flex_logits, flex_grads = _loss_and_grads(_config(position, params_dtype, backend), state)
    grad_diff = max((flex_grads[n] - sdpa_grads[n]).abs().max().item() / (sdpa_grads[n].abs().max().item() + 1e-12)
                    for n in sdpa_grads)
    config = _config(position, params_dtype, backend)
    dtype = torch.bfloat16 if params_dtype == "bf16" else torch.float32
    # The logits: the whole model's depth in its dtype. A gradient: the forward's roundings, one product back
    # through each, the weight gradient's own (step_depth), its longest sum over the MLP's width or the 2 x SEQ
    # tokens; relative to the parameter's largest gradient.
    grad_bound = tolerance(dtype, step_depth(config.num_layers), max(config.ffn_size, 2 * SEQ))
    return ((flex_logits - sdpa_logits).abs().max().item(), grad_diff,
            model_tolerance(config, dtype, sdpa_logits), grad_bound)


@pytest.fixture
def small_backward_blocks(monkeypatch):
    monkeypatch.setattr(attention_core, "FLEX_CPU_BACKWARD_BLOCK", 16)


@pytest.mark.parametrize("position, params_dtype", [("alibi", "fp32"), ("absolute", "fp32"), ("llama", "fp32"),
                                                    ("alibi", "bf16"), ("mla", "fp32")])
def test_flex_equals_sdpa_at_tp1(small_backward_blocks, position, params_dtype):
    logits_diff, grad_diff, logits_bound, grad_bound = _max_diffs(position, params_dtype, ParallelState.single())
    assert logits_diff <= logits_bound, (logits_diff, grad_diff)
    assert grad_diff <= grad_bound, (logits_diff, grad_diff)


@pytest.mark.parametrize("position, params_dtype", [("alibi", "fp32"), ("absolute", "fp32"), ("llama", "fp32"),
                                                    ("alibi", "bf16"), ("llama", "bf16"), ("mla", "fp32"),
                                                    ("mla", "bf16")])
def test_unfused_equals_sdpa(position, params_dtype):
    """The plain-matmul path (GQA by repeating key / value heads, the causal mask built when SDPA would use
    is_causal) gives SDPA's logits and gradients."""
    logits_diff, grad_diff, logits_bound, grad_bound = _max_diffs(position, params_dtype, ParallelState.single(),
                                                                  backend="unfused")
    assert logits_diff <= logits_bound, (logits_diff, grad_diff)
    assert grad_diff <= grad_bound, (logits_diff, grad_diff)


def _tp2_diffs(rank, world_size):
    attention_core.FLEX_CPU_BACKWARD_BLOCK = 16
    state = ParallelState.create(tp=2, pp=1)
    layer = SelfAttention(tiny_config(position_embedding_type="alibi"), state.layer_groups())
    return _max_diffs("alibi", "fp32", state), layer.alibi_slopes.tolist()


@pytest.mark.multiprocess
def test_flex_equals_sdpa_at_tp2_with_each_ranks_slopes():
    (diffs0, slopes0), (diffs1, slopes1) = run_distributed(_tp2_diffs, world_size=2, timeout=240)
    assert slopes0 != slopes1  # rank 1's heads have other slopes, so a wrong score_mod would show
    for rank, (logits_diff, grad_diff, logits_bound, grad_bound) in enumerate((diffs0, diffs1)):
        assert logits_diff <= logits_bound, f"rank {rank}: {logits_diff}, {grad_diff}"
        assert grad_diff <= grad_bound, f"rank {rank}: {logits_diff}, {grad_diff}"


def test_decoding_with_a_kv_cache_under_flex_equals_its_full_forward():
    layer = SelfAttention(tiny_config(position_embedding_type="alibi", seq_length=SEQ, attention_backend="flex"))
    hidden = torch.randn(SEQ, 2, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = layer(hidden)  # flex (no grad: torch's own CPU forward)
        cache = KVCache()
        steps = [layer(hidden[:32], cache)] + [layer(hidden[i:i + 1], cache) for i in range(32, SEQ)]  # SDPA
    # One attention layer: the QKV product, Q.K^T, the ALiBi bias, softmax, probabilities x V, the dense product
    # (depth 6), summing over the hidden size (64) at most.
    diff = (torch.cat(steps) - full).abs().max().item()
    assert diff <= tolerance(torch.float32, 6, 64, full.abs().max().item()), diff


@pytest.mark.parametrize("alibi, documents", [(True, False), (False, False), (True, True), (False, True)])
def test_flex_by_blocks_where_it_does_not_compile_equals_sdpas_dense_attention(monkeypatch, alibi, documents):
    """Where inductor cannot compile flex for the CPU (no AVX2 kernels), its forward is SDPA over blocks of queries
    (three blocks of 16 here, the last one short), each masked as flex masks it: the same as one dense SDPA call
    with the whole [b, np, s, s] mask (causal, ALiBi, packed documents)."""
    monkeypatch.setattr(attention_core, "flex_compiles_on_this_cpu", lambda: False)
    monkeypatch.setattr(attention_core, "FLEX_CPU_BACKWARD_BLOCK", 16)
    generator = torch.Generator().manual_seed(11)
    b, np_, ng, s, hn = 2, 4, 2, 40, 8
    query = torch.randn(b, np_, s, hn, generator=generator)
    key, value = (torch.randn(b, ng, s, hn, generator=generator) for _ in range(2))
    slopes = (0.5, 0.25, 0.125, 0.0625) if alibi else None
    document_ids = torch.tensor([[0] * 10 + [1] * 25 + [2] * 5, [0] * 40]) if documents else None
    got = attention_core.flex_core_attention(query, key, value, slopes, 0.3, document_ids)  # [b, np, s, hn]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]  # query, key positions
    visible = (j <= i)[None, None] & (True if document_ids is None else
                                      (document_ids[:, :, None] == document_ids[:, None, :])[:, None])  # [b?, 1, s, s]
    bias = torch.zeros(1, np_, s, s) if slopes is None else torch.tensor(slopes)[:, None, None] * (j - i)[None]
    mask = bias.masked_fill(~visible, float("-inf"))  # [b or 1, np, s, s]
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3,
                                                                enable_gqa=True)
    # Q.K^T scaled, the bias, the softmax's exp and normalization, probabilities x V: depth 6, sums over s keys.
    diff = (got - expected).abs().max().item()
    assert diff <= tolerance(torch.float32, 6, s, value.abs().max().item()), diff


def test_auto_keeps_sdpa_on_cpu_and_the_kv_cache_path_is_sdpa(monkeypatch):
    query = torch.zeros(1, 4, 8, 16)
    for alibi in (True, False):
        assert resolve_attention_backend("auto", query, alibi=alibi, dropout_p=0.0, decoding=False) == "sdpa"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # inside --torch-compile's trace
    assert resolve_attention_backend("auto", query, alibi=True, dropout_p=0.0, decoding=False) == "unfused"
    long_query = torch.zeros(1, 4, 2048, 16)  # s^2 probabilities kept for backward: too many, stay on sdpa
    assert resolve_attention_backend("auto", long_query, alibi=True, dropout_p=0.0, decoding=False) == "sdpa"
    assert resolve_attention_backend("auto", query, alibi=True, dropout_p=0.0, decoding=True) == "sdpa"
    monkeypatch.undo()
    assert resolve_attention_backend("flex", query, alibi=True, dropout_p=0.0, decoding=True) == "sdpa"
    assert resolve_attention_backend("flex", query, alibi=True, dropout_p=0.0, decoding=False) == "flex"


def test_flash_and_flex_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="flash-attn package, a CUDA device"):
        resolve_attention_backend("flash", torch.zeros(1, 4, 8, 16), alibi=True, dropout_p=0.0, decoding=False)
    with pytest.raises(ValueError, match="set --attention-dropout 0"):
        tiny_config(attention_backend="flex", attention_dropout=0.1)
    with pytest.raises(ValueError, match="--attention-backend 'fast' is not one of auto, sdpa, flex, flash, unfused"):
        tiny_config(attention_backend="fast")


def test_the_flag_reaches_the_model_config(tiny_corpus):
    from megatron.arguments import run_config_from_argv
    from megatron.testing.tiny_corpus import tiny_argv

    assert run_config_from_argv(tiny_argv(tiny_corpus), world_size=1).model.attention_backend == "auto"
    chosen = run_config_from_argv(tiny_argv(tiny_corpus, attention_backend="flex"), world_size=1)
    assert chosen.model.attention_backend == "flex"


@pytest.mark.parametrize("mask_kind", ["rows_bias", "shared_bias", "rows_bool", "none"])
@pytest.mark.parametrize("groups", [4, 2])
def test_the_decode_core_equals_sdpa_for_one_token_per_row_reading_a_cache_view(mask_kind, groups):
    generator = torch.Generator().manual_seed(7)
    b, np_, hn, sk = 3, 4, 8, 10
    query = torch.randn(1, b, np_, hn, generator=generator).permute(1, 2, 0, 3)  # [b, np, 1, hn], not contiguous
    storage = torch.randn(2, 5, groups, 16, hn, generator=generator)  # [k / v, rows, ng, cap, hn], as BatchKVCache
    key, value = storage[0, :b, :, :sk], storage[1, :b, :, :sk]  # [b, ng, sk, hn] views
    lengths = torch.tensor([3, 10, 6])
    visible = torch.arange(sk)[None, :] < lengths[:, None]  # [b, sk]
    masks = {"rows_bias": torch.randn(b, np_, 1, sk, generator=generator).masked_fill(~visible[:, None, None], float("-inf")),
             "shared_bias": torch.randn(1, np_, 1, sk, generator=generator),
             "rows_bool": visible[:, None, None, :], "none": None}
    mask = masks[mask_kind]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=0.3, enable_gqa=groups != np_)  # [b, np, 1, hn]
    got = attention_core.unfused_core_attention(query, key, value, mask, 0.0, 0.3)
    assert got.shape == (b, np_, 1, hn)
    # The scaling, Q.K^T, the bias, the softmax's exp and normalization, probabilities x V: depth 6, summing over
    # at most the sk = 10 positions; the context is a weighted mean of the values, rounded on their size.
    diff = (got - expected).abs().max().item()
    assert diff <= tolerance(torch.float32, 6, sk, value.abs().max().item()), (diff, mask_kind, groups)


def test_one_fp32_token_per_row_on_cpu_decodes_with_the_decode_core():
    for dtype, sq, backend in ((torch.float32, 1, "decode"), (torch.bfloat16, 1, "sdpa"), (torch.float32, 3, "sdpa")):
        query = torch.zeros(2, 4, sq, 16, dtype=dtype)
        assert resolve_attention_backend("auto", query, alibi=True, dropout_p=0.0, decoding=True) == backend
        assert resolve_attention_backend("sdpa", query, alibi=False, dropout_p=0.0, decoding=True) == backend


@pytest.mark.parametrize("backend", ["flex", "unfused"])
def test_mla_routes_its_core_attention_through_the_backend(monkeypatch, backend):
    """MultiLatentAttention's core runs the kernel --attention-backend names (its numerics: the model tests above),
    with its own scale 1 / sqrt(dn + dr) and value heads of v-head-dim."""
    import megatron.model.latent_attention as latent_attention

    calls = []

    def spy(query, key, value, *args):
        calls.append((query.shape, value.shape, args[-1]))
        return query.new_zeros(query.shape[:3] + value.shape[-1:])  # [b, np, sq, dv]

    monkeypatch.setattr(latent_attention, f"{backend}_core_attention", spy)
    layer = latent_attention.MultiLatentAttention(tiny_config(**MLA, attention_backend=backend))
    layer(torch.randn(8, 2, 64))
    assert calls == [(torch.Size([2, 4, 8, 24]), torch.Size([2, 4, 8, 12]), 1.0 / math.sqrt(24))], calls


def test_mla_decoding_with_a_kv_cache_equals_its_full_forward():
    """One fp32 token at a time on CPU: the decode core (unfused) with value heads (12) narrower than the query /
    key heads (24)."""
    from megatron.model.latent_attention import MultiLatentAttention

    layer = MultiLatentAttention(tiny_config(**MLA, seq_length=SEQ)).eval()
    hidden = torch.randn(SEQ, 2, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = layer(hidden)
        cache = KVCache()
        steps = [layer(hidden[:32], cache)] + [layer(hidden[i:i + 1], cache) for i in range(32, SEQ)]
    # One MLA layer: its depth (tests/model/test_latent_attention.py), summing over the hidden size (64) at most.
    diff = (torch.cat(steps) - full).abs().max().item()
    assert diff <= tolerance(torch.float32, 11, 64, full.abs().max().item()), diff


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_a_model_trains_after_generating_in_inference_mode(backend):
    """The cached attention tensors (ALiBi's shared bias, flex's block mask and slopes) are built outside inference
    mode even when a generation (torch.inference_mode) asks for them first: training in the same process, at the
    same shapes, can save them for backward (with an inference tensor cached: "Inference tensors cannot be saved for
    backward"). A sequence length no other test uses, so the caches start empty for it."""
    model = GPTModel(tiny_config(seq_length=37, max_position_embeddings=37, position_embedding_type="alibi",
                                 attention_backend=backend))
    tokens = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(tokens)
    loss = model(tokens, labels=tokens).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

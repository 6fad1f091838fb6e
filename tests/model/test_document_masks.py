"""--reset-attention-mask in the model: a packed sample's per-token losses, and the gradients of their sum, equal
those of its documents run one at a time at position 0 (an independent reference for the mask: no mask there at
all, each document is its own causal sequence), for each attention backend that runs here (sdpa, unfused; flex, a
compile each, with ALiBi; flash does not run on CPU) and each position type (ALiBi, rotary with GQA, learned
positions with --reset-position-ids, multi-head latent attention), within the tolerance of the model's depth in fp32
(megatron.testing.tolerance). Without the document ids the packed losses differ (the mask is what is tested)."""

import pytest
import torch

from megatron.config.mla import MLAConfig
from megatron.model import GPTModel
from megatron.testing.tolerance import model_tolerance, step_depth, tolerance
from megatron.training.batches import document_ids, gpt_micro_batch
from tests.helpers.model import tiny_config

SEQ = 48
EOD = 7
# the input positions of the end-of-document tokens of each row: documents of 11, 1, 20, 16 and of 30, 18 tokens
EODS = ((10, 11, 31), (29, 47))
BACKENDS = ("sdpa", "unfused", "flex")
# the position types and attentions (as tests/model/test_attention_backends.py's): ALiBi, learned positions, a
# Llama-style rotary + GQA block, multi-head latent attention with value heads narrower than its query / key heads
LLAMA = dict(position_embedding_type="rotary", normalization="rmsnorm", swiglu=True, num_key_value_heads=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=96)
MLA = dict(LLAMA, num_key_value_heads=None, qk_layernorm=True,
           mla=MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12))
CONFIGS = {"alibi": dict(position_embedding_type="alibi", embed_layernorm=True),
           "absolute": dict(position_embedding_type="absolute"), "llama": LLAMA, "mla": MLA}


def _packed_tokens() -> torch.Tensor:
    """[2, SEQ + 1] tokens with the end-of-document token exactly at EODS (the last one the last input of row 1)."""
    tokens = torch.randint(0, 256, (len(EODS), SEQ + 1), generator=torch.Generator().manual_seed(3))
    tokens[tokens == EOD] = EOD + 1
    for row, eods in enumerate(EODS):
        tokens[row, list(eods)] = EOD
    return tokens


def _per_token_and_grads(model, input_ids, position_ids, labels, documents=None):
    model.zero_grad()
    extra = {} if documents is None else {"document_ids": documents}
    per_token = model(input_ids, position_ids, labels=labels, **extra)  # [b, s]
    per_token.sum().backward()
    return per_token.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def references():
    """Per configuration: each document alone at position 0 (SDPA, is_causal, no mask): the per-token losses of
    the packed samples' places and the gradients of their sum."""
    (input_ids, _), (labels, _) = gpt_micro_batch(_packed_tokens())
    documents = document_ids(input_ids, EOD)
    out = {}
    for name, overrides in CONFIGS.items():
        model = GPTModel(tiny_config(seq_length=SEQ, max_position_embeddings=SEQ, **overrides))
        losses = torch.empty(input_ids.shape)
        grads = {}
        for row in range(input_ids.shape[0]):
            for doc in documents[row].unique().tolist():
                where = (documents[row] == doc).nonzero().flatten()
                part = slice(int(where[0]), int(where[-1]) + 1)
                positions = torch.arange(part.stop - part.start)[None]  # [1, len]: the document alone
                per_token, doc_grads = _per_token_and_grads(model, input_ids[row:row + 1, part], positions,
                                                            labels[row:row + 1, part])
                losses[row, part] = per_token[0]
                for key, grad in doc_grads.items():
                    grads[key] = grads.get(key, 0) + grad
        out[name] = (losses, grads)
    return out


def test_document_ids_split_after_each_eod():
    (input_ids, _), _ = gpt_micro_batch(_packed_tokens())
    documents = document_ids(input_ids, EOD)
    assert documents[0, :11].eq(0).all() and documents[0, 11].item() == 1 and documents[0, 12:32].eq(2).all()
    assert documents[0, 32:].eq(3).all() and documents[1, :30].eq(0).all() and documents[1, 30:].eq(1).all()
    (_, _, carried), _ = gpt_micro_batch(_packed_tokens(), EOD, reset_attention_mask=True)
    assert torch.equal(carried, documents)


# flex compiles a kernel per configuration (9 to 22 s each on a cold cache): for ALiBi only, its score_mod with the
# document mask_mod (the kernel CUDA's auto picks for ALiBi and for documents); the other configurations' kernels
# differ from it by what the mask does not touch (no score_mod, grouped key / value heads, another value head size)
CASES = [(name, backend, "") for name in CONFIGS for backend in BACKENDS if backend != "flex" or name == "alibi"]
# the core attention recomputed in backward (--recompute-granularity selective: the ids are its checkpoint's input),
# and MLA's up-projections recomputed (--recompute-modules mla_up_proj)
RECOMPUTE = {"selective": dict(recompute_core_attention=True), "mla_up_proj": dict(recompute_modules=("mla_up_proj",))}
CASES += [("alibi", "flex", "selective"), ("llama", "sdpa", "selective"), ("mla", "unfused", "selective"),
          ("mla", "sdpa", "mla_up_proj")]


@pytest.mark.parametrize(("name", "backend", "recompute"), CASES)
def test_packed_documents_equal_documents_alone(references, name, backend, recompute):
    overrides = dict(CONFIGS[name], **RECOMPUTE.get(recompute, {}))
    config = tiny_config(seq_length=SEQ, max_position_embeddings=SEQ, attention_backend=backend, **overrides)
    model = GPTModel(config)
    reset_positions = config.position_embedding_type == "absolute"  # learned positions read the position ids
    (input_ids, position_ids, documents), (labels, _) = gpt_micro_batch(
        _packed_tokens(), EOD, reset_position_ids=reset_positions, reset_attention_mask=True)
    losses, grads = _per_token_and_grads(model, input_ids, position_ids, labels, documents)
    reference_losses, reference_grads = references[name]

    bound = model_tolerance(config, torch.float32, reference_losses)
    assert (losses - reference_losses).abs().max().item() <= bound
    for key, reference in reference_grads.items():
        grad_bound = tolerance(torch.float32, step_depth(config.num_layers), SEQ * len(EODS),
                               scale=reference.abs().max().item())
        assert (grads[key] - reference).abs().max().item() <= grad_bound, key

    with torch.no_grad():  # the mask is what makes them equal: the whole-sample causal run differs
        unmasked = model(input_ids, position_ids, labels=labels)
    assert (unmasked - reference_losses).abs().max().item() > 10 * bound


@pytest.mark.parametrize("alibi", [False, True], ids=["no bias", "alibi"])
def test_sdpa_runs_each_document_alone_as_the_dense_mask_does_without_an_s_by_s_tensor(alibi):
    """sdpa's document path (one SDPA call per document, attention_core.sdpa_per_document) against the dense
    [b, 1, s, s] mask it replaces (kept where dropout draws the whole sample's mask): the same context and gradients
    in float64 (GQA, value heads narrower than the query / key heads, rows of different documents), and nothing of
    s x s kept for backward."""
    from megatron.model.attention_core import document_causal_mask, document_runs, sdpa_per_document

    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2], [4, 4, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6]])
    assert document_runs(ids) == [[(0, 3), (3, 5), (5, 12)], [(0, 2), (2, 9), (9, 12)]]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 12, dim, generator=gen, dtype=torch.float64, requires_grad=True)
               for heads, dim in ((4, 8), (2, 8), (2, 6)))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.shape[-2:]) or t, lambda t: t):
        ours = sdpa_per_document(q, k, v, ids, slopes, 0.3)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=document_causal_mask(ids, slopes, torch.float64), scale=0.3, enable_gqa=True)
    grad = torch.randn(dense.shape, generator=gen, dtype=torch.float64)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    dense_grads = torch.autograd.grad(dense, (q, k, v), grad)
    bound = tolerance(torch.float64, 6, 12, 1.0)
    assert (ours - dense).abs().max() <= bound
    for a, b in zip(ours_grads, dense_grads):
        assert (a - b).abs().max() <= bound * max(1.0, b.abs().max().item())
    assert all(tuple(size) != (12, 12) for size in sizes), sizes  # the longest document is 7: no [s, s] tensor

"""Comparisons with transformers' models: logits of the same weights, greedy text, and tools/generate.py's."""

import json
import math

import torch

from megatron.testing.tolerance import OPS_AROUND_LAYERS, OPS_PER_LAYER, tolerance, transformer_depth
from tools import generate
from tools.convert_checkpoint import from_hf, to_hf

# Roundings in sequence that a layer adds to the dense one megatron.testing.tolerance counts (OPS_PER_LAYER):
# - an MoE MLP in place of the dense one's two products and activation (3): the router's product, the scores and
#   their renormalization (6), the expert's two products, activation and gate product (4), the weighting and the
#   sum over the chosen experts (2), the shared expert's sum: 13 (tests/model/test_moe's LAYER_DEPTH), 10 more;
MOE_EXTRA = 10
# - multi-head latent attention in place of the QKV product, Q.K^T, softmax, P.V and the dense product (5): the
#   latents' down products, their norms, the up products, the rotary's product and sum, Q.K^T, the scaling,
#   softmax's exp and normalization, P.V, the dense product: 11 (tests/model/test_latent_attention's DEPTH), 6 more;
MLA_EXTRA = 6
# - a norm of each query and key head (--qk-layernorm) before Q.K^T: 1 more (MLA's latent norms counted above).
QK_NORM_EXTRA = 1


def forward_depth(config) -> int:
    """Roundings in sequence between a token and a logit of the model ``config`` describes (a ModelConfig):
    ``transformer_depth`` for a dense model, more for MoE, latent-attention and QK-norm layers (above)."""
    depth = transformer_depth(config.num_layers)
    if config.moe is not None:
        depth += MOE_EXTRA * sum(config.moe.layer_pattern)
    if config.mla is not None:
        depth += MLA_EXTRA * config.num_layers
    elif config.qk_layernorm:
        depth += QK_NORM_EXTRA * config.num_layers
    return depth


def logits_tolerance(config, reference: torch.Tensor) -> float:
    """How far two computations (ours, transformers') of the logits ``reference`` of the model ``config`` can be
    apart: ``megatron.testing.tolerance.model_tolerance`` (the same for a dense model) at ``forward_depth``."""
    width = max(config.hidden_size, config.ffn_hidden_size or 4 * config.hidden_size)
    return tolerance(torch.float32, forward_depth(config), width, scale=reference.abs().max().item())


def run_layers(config) -> int:
    """As many dense layers as are as deep as ``config``'s model (``forward_depth``): the ``num_layers`` to give
    ``run_tolerance`` / ``assert_same_run`` for training runs of it."""
    return math.ceil((forward_depth(config) - OPS_AROUND_LAYERS) / OPS_PER_LAYER)


def hf_logits_diff(hf_model, config, state, vocab=400, seq=32):
    """(the largest logit difference between transformers' model and ours holding ``state`` on 2 sequences of
    ``seq`` tokens, the tolerance for it: ``logits_tolerance``)."""
    from megatron.model import GPTModel

    ours = GPTModel(config).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_model(ids).logits  # [b, s, v]
        mine = ours(ids).transpose(0, 1)[..., :vocab]  # [b, s, v]
    return (theirs - mine).abs().max().item(), logits_tolerance(config, theirs)


def hf_greedy(hf_model, tokenizer, prompts, max_new_tokens=32):
    """transformers' greedy continuation of each prompt (tokenized by ``tokenizer``, ours): token ids."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.tokenize(prompt)])
        generated = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, pad_token_id=0)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


def generate_tool(ckpt, out_json, prompts, max_new_tokens=32):
    """tools/generate.py --greedy on ``ckpt`` for ``prompts``: its JSON results (written to ``out_json``)."""
    argv = ["--load", str(ckpt), "--greedy", "--max-new-tokens", str(max_new_tokens), "--output-json", str(out_json)]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    assert generate.main(argv) == 0
    return json.loads(out_json.read_text())


def save_with_tiny_tokenizer(hf_model, path, tiny_corpus):
    """``hf_model.save_pretrained(path)`` with the tiny corpus' GPT-2 tokenizer beside it (a tokenizer.json)."""
    from megatron.checkpoint.hf.io import export_tokenizer

    hf_model.save_pretrained(str(path))
    export_tokenizer({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": tiny_corpus["vocab_file"],
                      "merge_file": tiny_corpus["merge_file"]}, str(path))
    return path


def import_hf(hf_dir, ckpt, tp=1, pp=1, ep=1, seq_length=32):
    """tools/convert_checkpoint/from_hf.py on ``hf_dir`` into ``ckpt`` at the given TP / PP / EP."""
    assert from_hf.main(["--hf-dir", str(hf_dir), "--save", str(ckpt), "--tensor-model-parallel-size", str(tp),
                         "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep),
                         "--seq-length", str(seq_length)]) == 0


def export_round_trip(ckpt, hf_in, out_dir):
    """tools/convert_checkpoint/to_hf.py on ``ckpt`` into ``out_dir``: (the tensors of ``hf_in``, the names of those
    the export does not reproduce bit for bit or lacks, the names it adds)."""
    from safetensors.torch import load_file

    assert to_hf.main(["--load", str(ckpt), "--output-dir", str(out_dir)]) == 0
    before, after = load_file(str(hf_in / "model.safetensors")), load_file(str(out_dir / "model.safetensors"))
    changed = [name for name, tensor in before.items() if name not in after or not torch.equal(after[name], tensor)]
    return before, changed, sorted(set(after) - set(before))


def greedy_pair(hf_model, hf_in, ckpt, out_json, prompts, max_new_tokens):
    """(tools/generate.py --greedy's token ids on ``ckpt``, transformers' on ``hf_model``), ``hf_in``'s tokenizer."""
    from megatron.config import TokenizerConfig
    from megatron.data.tokenizers import build_tokenizer

    results = generate_tool(ckpt, out_json, prompts, max_new_tokens=max_new_tokens)
    tokenizer = build_tokenizer(TokenizerConfig("PretrainedFromHF", tokenizer_name_or_path=str(hf_in)))
    return [r["token_ids"] for r in results], hf_greedy(hf_model, tokenizer, prompts, max_new_tokens=max_new_tokens)

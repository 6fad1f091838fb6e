"""Comparisons with transformers' models: logits of the same weights, greedy text, and tools/generate.py's."""

import json

import torch

from megatron.testing.tolerance import model_tolerance
from tools import generate


def hf_logits_diff(hf_model, config, state, vocab=400):
    """(the largest logit difference between transformers' model and ours holding ``state``, the tolerance
    for it: ``megatron.testing.tolerance.model_tolerance``)."""
    from megatron.model import GPTModel

    ours = GPTModel(config).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_model(ids).logits  # [b, s, v]
        mine = ours(ids).transpose(0, 1)[..., :vocab]  # [b, s, v]
    return (theirs - mine).abs().max().item(), model_tolerance(config, torch.float32, theirs)


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

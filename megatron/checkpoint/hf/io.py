"""Our full (TP=1) weights <-> transformers model directories: Bloom (ALiBi), GPT-2 (learned positions),
GPT-NeoX (rotary), the Llama family (Llama, Mistral, Qwen2) and its MoE relatives (Mixtral, Qwen3-MoE).

    write_hf_model(config, state_dict, out_dir, tokenizer=..., pretraining_tp=...)   -> config.json, model.safetensors
    config, state_dict, info = read_hf_model(hf_dir, padded_vocab_size=..., seq_length=...)

Which transformers architecture a configuration maps to:

- ALiBi + embedding LayerNorm  -> ``BloomForCausalLM``: the same tensors, renamed (``megatron.checkpoint.hf.bloom``).
- learned absolute positions, no embedding LayerNorm -> ``GPT2LMHeadModel``. GPT-2 stores its
  linear layers as ``Conv1D`` ([in, out], so every matrix is transposed) and its fused ``c_attn``
  columns as [q of all heads | k of all heads | v of all heads], where our rows are per head
  [heads, 3, hn]; both are converted here. GeLU tanh = ``gelu_new``; scale 1/sqrt(hn).
- rotary, no embedding LayerNorm -> ``GPTNeoXForCausalLM`` with sequential residuals
  (use_parallel_residual False), full rotary (partial_rotary_factor 1, rope_theta = rotary_base),
  biases, a tied head: again the same per-head fused QKV, renamed.
- RMSNorm + SwiGLU + rotary (GQA, biases and head tying as configured) -> ``LlamaForCausalLM``, or
  ``Qwen2ForCausalLM`` with q / k / v biases only (``megatron.checkpoint.hf.llama``); a Mistral
  directory without sliding window reads as the same model.
- the same with MoE layers (``--num-experts``, softmax top-k routing) -> ``MixtralForCausalLM``, or
  ``Qwen3MoeForCausalLM`` with ``--qk-layernorm`` (``megatron.checkpoint.hf.mixtral_qwen3``).
- MoE with ``--multi-latent-attention`` (sigmoid, group-limited routing, expert bias, a shared expert) ->
  ``DeepseekV3ForCausalLM`` (``megatron.checkpoint.hf.deepseek``).
The first three need the GPT block: LayerNorm, GeLU, biases, one key / value head per query head and
a tied head; anything else is refused rather than exported wrongly.

The vocabulary is trimmed to ``original_vocab_size`` on export and zero-padded to the padded size on
import: a zero row gives its (never real) token the logit 0 and leaves every real token's logit
unchanged; generation masks padded ids, and training quickly pushes their probability down.

Shape letters: s sequence, b micro-batch, h hidden, np heads per partition, hn head dim,
hp = np * hn, v / vp vocabulary (per partition).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from megatron.checkpoint.hf.bloom import (
    bloom_config_kwargs,
    bloom_state_dict_to_ours,
    model_config_from_bloom,
    ours_to_bloom_state_dict,
)
from megatron.checkpoint.hf.deepseek import (
    DEEPSEEK_V3,
    check_deepseek,
    deepseek_config_kwargs,
    deepseek_state_dict_to_ours,
    model_config_from_deepseek,
    ours_to_deepseek_state_dict,
)
from megatron.checkpoint.hf.llama import (
    LLAMA_FAMILY,
    llama_config_kwargs,
    llama_family_of,
    llama_state_dict_to_ours,
    model_config_from_llama,
    ours_to_llama_state_dict,
)
from megatron.checkpoint.hf.mixtral_qwen3 import (
    MOE_FAMILY,
    model_config_from_moe,
    moe_config_kwargs,
    moe_family_of,
    moe_state_dict_to_ours,
    ours_to_moe_state_dict,
)
from megatron.checkpoint.single_process import router_buffer_names
from megatron.config import ModelConfig
from megatron.data.tokenizers import EOD_TOKEN_CANDIDATES
from megatron.model.layout import parameter_layout

__all__ = ["hf_architecture", "write_hf_model", "read_hf_model", "export_tokenizer", "ours_to_gpt2_state_dict",
           "gpt2_state_dict_to_ours", "ours_to_neox_state_dict", "neox_state_dict_to_ours"]

_GPT2_BLOCK = [  # (GPT-2 name, our name, transposed: GPT-2's Conv1D stores [in, out])
    ("ln_1.weight", "input_layernorm.weight", False),
    ("ln_1.bias", "input_layernorm.bias", False),
    ("attn.c_proj.weight", "self_attention.dense.weight", True),
    ("attn.c_proj.bias", "self_attention.dense.bias", False),
    ("ln_2.weight", "post_attention_layernorm.weight", False),
    ("ln_2.bias", "post_attention_layernorm.bias", False),
    ("mlp.c_fc.weight", "mlp.dense_h_to_4h.weight", True),
    ("mlp.c_fc.bias", "mlp.dense_h_to_4h.bias", False),
    ("mlp.c_proj.weight", "mlp.dense_4h_to_h.weight", True),
    ("mlp.c_proj.bias", "mlp.dense_4h_to_h.bias", False),
]


def hf_architecture(config: ModelConfig) -> str:
    """'bloom', 'gpt2', 'gpt_neox', 'llama', 'qwen2', 'mixtral', 'qwen3_moe' or 'deepseek_v3', or ValueError for a
    configuration no transformers architecture maps."""
    if config.mla is not None:
        check_deepseek(config)
        return "deepseek_v3"
    if config.moe is not None:
        return moe_family_of(config)
    if config.qk_layernorm:
        raise ValueError("--qk-layernorm on a dense model: no transformers architecture is mapped for it here "
                         "(Qwen3-MoE is, with --num-experts)")
    if config.normalization == "rmsnorm" or config.swiglu:
        return llama_family_of(config)
    gpt_block = {"biases": config.add_bias_linear, "one key / value head per query head":
                 config.num_kv_heads == config.num_attention_heads, "a tied output head": config.tied_embeddings}
    missing = [what for what, present in gpt_block.items() if not present]
    if missing:
        raise ValueError(f"Bloom, GPT-2 and GPT-NeoX need the GPT block (LayerNorm, GeLU, biases, multi-head "
                         f"attention, tied head); this model lacks {', '.join(missing)}. With RMSNorm and SwiGLU it "
                         f"would export to Llama")
    if config.position_embedding_type == "alibi" and config.embed_layernorm:
        return "bloom"
    if config.position_embedding_type == "absolute" and not config.embed_layernorm:
        return "gpt2"
    if config.position_embedding_type == "rotary" and not config.embed_layernorm:
        return "gpt_neox"
    raise ValueError(f"no transformers architecture maps position_embedding_type "
                     f"{config.position_embedding_type!r} with embed_layernorm {config.embed_layernorm} here: "
                     f"ALiBi + embedding LayerNorm exports to Bloom, learned positions without it to GPT-2, "
                     f"rotary without it to GPT-NeoX")


def check_covers_layout(names, config: ModelConfig, family: str) -> None:
    """ValueError unless ``names`` are exactly the parameters ``megatron.model.layout`` lists for
    ``config``: a parameter a model variant adds must be mapped, never silently dropped."""
    expected = set(parameter_layout(config))
    missing, unexpected = sorted(expected - set(names)), sorted(set(names) - expected)
    if missing or unexpected:
        raise ValueError(f"the {family} mapping does not cover this model: missing {missing}, unexpected {unexpected}")


# Our GPTModel name prefix -> GPT-NeoX's: the same tensors, renamed.
_NEOX_PREFIXES = (("embedding.word_embeddings.", "gpt_neox.embed_in."), ("final_layernorm.", "gpt_neox.final_layer_norm."),
                  ("layers.", "gpt_neox.layers."))


def _neox_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(GPT-NeoX name, our name) of every parameter of ``megatron.model.layout``."""
    pairs = []
    for name in parameter_layout(config):
        prefix = next((p for p in _NEOX_PREFIXES if name.startswith(p[0])), None)
        if prefix is None:
            raise ValueError(f"{name!r} has no counterpart in transformers' GPT-NeoX")
        pairs.append((prefix[1] + name[len(prefix[0]):].replace(".self_attention.", ".attention."), name))
    return pairs


def ours_to_neox_state_dict(state: dict[str, torch.Tensor], config: ModelConfig,
                            vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A TP=1 GPTModel state dict (rotary) -> ``GPTNeoXForCausalLM`` names (without the tied lm_head)."""
    check_covers_layout(state, config, "GPT-NeoX")
    out = {theirs: state[ours] for theirs, ours in _neox_names(config)}
    if vocab_size is not None:
        out["gpt_neox.embed_in.weight"] = out["gpt_neox.embed_in.weight"][:vocab_size]  # [v, h]
    return out


def neox_state_dict_to_ours(neox: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``GPTNeoXForCausalLM`` state dict -> a TP=1 GPTModel state dict (vocab zero-padded)."""
    state = dict(neox)
    lm_head = state.pop("lm_head.weight", state.pop("embed_out.weight", None))
    ours = {}
    for theirs, mine in _neox_names(config):
        if theirs not in state:
            raise ValueError(f"GPT-NeoX tensor {theirs} is missing")
        ours[mine] = state.pop(theirs)
    if state:
        raise ValueError(f"GPT-NeoX tensors this converter does not know: {sorted(state)}")
    words = ours["embedding.word_embeddings.weight"]  # [v, h]
    if lm_head is not None and not torch.equal(lm_head, words):
        raise ValueError("GPT-NeoX's lm_head differs from embed_in; GPTModel ties the output head to the embedding")
    padding = words.new_zeros(config.padded_vocab_size - words.shape[0], words.shape[1])
    ours["embedding.word_embeddings.weight"] = torch.cat((words, padding), dim=0)  # [padded, h]
    return ours


def _per_head_to_grouped(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """QKV rows [heads, 3, hn] (ours) -> [3, heads, hn] (GPT-2's q | k | v), any trailing dims."""
    rest = tensor.shape[1:]
    hn = tensor.shape[0] // (3 * heads)
    return tensor.reshape(heads, 3, hn, *rest).transpose(0, 1).reshape(3 * heads * hn, *rest)


def _grouped_to_per_head(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """QKV rows [3, heads, hn] (GPT-2) -> [heads, 3, hn] (ours)."""
    rest = tensor.shape[1:]
    hn = tensor.shape[0] // (3 * heads)
    return tensor.reshape(3, heads, hn, *rest).transpose(0, 1).reshape(3 * heads * hn, *rest)


def ours_to_gpt2_state_dict(state: dict[str, torch.Tensor], config: ModelConfig,
                            vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A TP=1 GPTModel state dict (learned positions) -> ``GPT2LMHeadModel`` names (without the tied lm_head)."""
    check_covers_layout(state, config, "GPT-2")
    heads = config.num_attention_heads
    words = state["embedding.word_embeddings.weight"]  # [padded, h]
    out = {"transformer.wte.weight": words[:vocab_size] if vocab_size is not None else words,
           "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": state["final_layernorm.weight"],
           "transformer.ln_f.bias": state["final_layernorm.bias"]}
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        qkv_w = state[ours + "self_attention.query_key_value.weight"]  # [3h, h], rows per head
        out[theirs + "attn.c_attn.weight"] = _per_head_to_grouped(qkv_w, heads).t().contiguous()  # [h, 3h]
        out[theirs + "attn.c_attn.bias"] = _per_head_to_grouped(state[ours + "self_attention.query_key_value.bias"],
                                                               heads)  # [3h]
        for hf_name, our_name, transposed in _GPT2_BLOCK:
            tensor = state[ours + our_name]
            out[theirs + hf_name] = tensor.t().contiguous() if transposed else tensor
    return out


def gpt2_state_dict_to_ours(gpt2: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` / ``GPT2Model`` state dict -> a TP=1 GPTModel state dict (vocab zero-padded)."""
    state = {name.removeprefix("transformer."): tensor for name, tensor in gpt2.items()
             if not name.endswith(".attn.bias") and not name.endswith(".attn.masked_bias")}  # old causal buffers
    lm_head = state.pop("lm_head.weight", None)
    heads = config.num_attention_heads
    words = state.pop("wte.weight")  # [v, h]
    if lm_head is not None and not torch.equal(lm_head, words):
        raise ValueError("lm_head.weight differs from wte.weight; GPTModel ties the output head to the embedding")
    if words.shape[0] > config.padded_vocab_size:
        raise ValueError(f"GPT-2 vocabulary {words.shape[0]} exceeds padded_vocab_size {config.padded_vocab_size}")
    padding = words.new_zeros(config.padded_vocab_size - words.shape[0], words.shape[1])
    ours = {"embedding.word_embeddings.weight": torch.cat((words, padding), dim=0),  # [padded, h]
            "embedding.position_embeddings.weight": state.pop("wpe.weight"),
            "final_layernorm.weight": state.pop("ln_f.weight"), "final_layernorm.bias": state.pop("ln_f.bias")}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"h.{i}."
        ours[mine + "self_attention.query_key_value.weight"] = _grouped_to_per_head(
            state.pop(theirs + "attn.c_attn.weight").t(), heads).contiguous()  # [3h, h]
        ours[mine + "self_attention.query_key_value.bias"] = _grouped_to_per_head(
            state.pop(theirs + "attn.c_attn.bias"), heads)
        for hf_name, our_name, transposed in _GPT2_BLOCK:
            tensor = state.pop(theirs + hf_name)
            ours[mine + our_name] = tensor.t().contiguous() if transposed else tensor
    if state:
        raise ValueError(f"GPT-2 tensors this converter does not know: {sorted(state)}")
    check_covers_layout(ours, config, "GPT-2")
    return ours


def _gpt2_config_kwargs(config: ModelConfig, vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, n_positions=config.max_positions, n_embd=config.hidden_size,
                n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_size,
                activation_function="gelu_new", layer_norm_epsilon=config.layernorm_epsilon,
                resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
                attn_pdrop=config.attention_dropout, initializer_range=config.init_method_std,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                tie_word_embeddings=True)


def _neox_config_kwargs(config: ModelConfig, vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_size,
                hidden_act="gelu_new", use_parallel_residual=False, tie_word_embeddings=True, attention_bias=True,
                attention_dropout=config.attention_dropout, hidden_dropout=config.hidden_dropout,
                layer_norm_eps=config.layernorm_epsilon, initializer_range=config.init_method_std,
                max_position_embeddings=config.seq_length,
                rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base,
                                 "partial_rotary_factor": 1.0})


def _model_config_from_neox(hf_config, seq_length: Optional[int], common: dict) -> ModelConfig:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    problems = {"use_parallel_residual": (hf_config.use_parallel_residual, False),
                "hidden_act": (hf_config.hidden_act in ("gelu_new", "gelu_pytorch_tanh"), True),
                "attention_bias": (getattr(hf_config, "attention_bias", True), True),
                "rope_type": (rope.get("rope_type", "default"), "default"),
                "partial_rotary_factor": (rope.get("partial_rotary_factor", 1.0), 1.0)}
    wrong = {name: got for name, (got, want) in problems.items() if got != want}
    if wrong:
        raise ValueError(f"this GPT-NeoX differs from our architecture in {wrong} (needed: sequential residual, "
                         f"tanh GeLU, biases, full default rotary)")
    return ModelConfig(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                       num_attention_heads=hf_config.num_attention_heads,
                       seq_length=seq_length or hf_config.max_position_embeddings,
                       ffn_hidden_size=hf_config.intermediate_size, position_embedding_type="rotary",
                       embed_layernorm=False, layernorm_epsilon=hf_config.layer_norm_eps,
                       rotary_base=float(rope.get("rope_theta", 10000.0)), hidden_dropout=hf_config.hidden_dropout,
                       attention_dropout=hf_config.attention_dropout, init_method_std=hf_config.initializer_range,
                       **common).validate()


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_hf_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], out_dir: str, *,
                   pretraining_tp: int = 1, eos_token_id: Optional[int] = None,
                   dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 << 30) -> str:
    """Write ``config.json`` + ``model.safetensors`` of the matching transformers model; return its architecture.

    The vocabulary is trimmed to ``config.original_vocab_size`` (the padding rows are ours only).
    pretraining_tp: the training TP, recorded in Bloom's config (``slow_but_exact`` stays False).
    max_shard_bytes: larger exports are split into transformers' sharded safetensors layout.
    """
    import transformers  # noqa: PLC0415 (transformers: seconds to import, only for an export or import)

    arch = hf_architecture(config)
    vocab_size = config.original_vocab_size or config.padded_vocab_size
    # None when the tokenizer is unknown (GPT-2's default 50256 would point outside a small vocabulary)
    special = dict(eos_token_id=eos_token_id, bos_token_id=eos_token_id)
    if arch == "bloom":
        tensors = ours_to_bloom_state_dict(state_dict, config, vocab_size, with_lm_head=False)
        hf_config = transformers.BloomConfig(**bloom_config_kwargs(config, vocab_size), pretraining_tp=pretraining_tp,
                                             slow_but_exact=False, **special)
        hf_config.architectures = ["BloomForCausalLM"]
    elif arch == "gpt2":
        tensors = ours_to_gpt2_state_dict(state_dict, config, vocab_size)
        hf_config = transformers.GPT2Config(**_gpt2_config_kwargs(config, vocab_size), **special)
        hf_config.architectures = ["GPT2LMHeadModel"]
    elif arch in LLAMA_FAMILY:
        tensors = ours_to_llama_state_dict(state_dict, config, vocab_size)
        if config.tied_embeddings:
            del tensors["lm_head.weight"]  # transformers ties it to embed_tokens (one stored tensor)
        kind = {"llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
                "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM")}[arch]
        hf_config = kind[0](**llama_config_kwargs(config, vocab_size), **special)
        hf_config.architectures = [kind[1]]
    elif arch in MOE_FAMILY:
        tensors = ours_to_moe_state_dict(state_dict, config, vocab_size)
        if config.tied_embeddings:
            del tensors["lm_head.weight"]
        kind = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig}[arch]
        hf_config = kind(**moe_config_kwargs(config, vocab_size), **special)
        hf_config.architectures = [MOE_FAMILY[arch]]
    elif arch in DEEPSEEK_V3:
        tensors = ours_to_deepseek_state_dict(state_dict, config, vocab_size)
        if config.tied_embeddings:
            del tensors["lm_head.weight"]
        hf_config = transformers.DeepseekV3Config(**deepseek_config_kwargs(config, vocab_size), **special)
        hf_config.architectures = [DEEPSEEK_V3[arch]]
    else:
        tensors = ours_to_neox_state_dict(state_dict, config, vocab_size)
        hf_config = transformers.GPTNeoXConfig(**_neox_config_kwargs(config, vocab_size), **special)
        hf_config.architectures = ["GPTNeoXForCausalLM"]
    if dtype is not None:
        tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    hf_config.dtype = _DTYPE_NAMES[next(iter(tensors.values())).dtype]
    os.makedirs(out_dir, exist_ok=True)
    hf_config.save_pretrained(out_dir)
    _save_safetensors(tensors, out_dir, max_shard_bytes)
    return arch


def _save_safetensors(tensors: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json (transformers'
    sharded layout) when the tensors exceed ``max_shard_bytes``; a tensor is never split."""
    from safetensors.torch import save_file  # noqa: PLC0415 (safetensors: only when HF weights are written or read)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _read_hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415 (safetensors: only when HF weights are written or read)

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(os.path.join(hf_dir, shard)).items()}
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    legacy = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise ValueError(f"{hf_dir!r} holds no model.safetensors(.index.json) or pytorch_model.bin; save the model "
                     f"with save_pretrained first")


def read_hf_model(hf_dir: str, *, padded_vocab_size_fn, seq_length: Optional[int] = None,
                  params_dtype: str = "fp32", seed: int = 1234) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(ModelConfig, TP=1 GPTModel state dict, architecture) of a local transformers Bloom / GPT-2 / GPT-NeoX /
    Llama / Mistral / Qwen2 directory.

    padded_vocab_size_fn: vocab size -> padded size (Megatron's rule for the target TP).
    seq_length: the training length to record (default: 2048 for Bloom, n_positions for GPT-2,
        max_position_embeddings for the others).
    """
    import transformers  # noqa: PLC0415 (transformers: seconds to import, only for an export or import)

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    arch = hf_config.model_type
    vocab = hf_config.vocab_size
    common = dict(padded_vocab_size=padded_vocab_size_fn(vocab), original_vocab_size=vocab,
                  params_dtype=params_dtype, seed=seed)
    if arch == "bloom":
        config = model_config_from_bloom(hf_config, seq_length or 2048, **common)
        state = bloom_state_dict_to_ours(_read_hf_tensors(hf_dir), config)
    elif arch == "gpt2":
        config = _model_config_from_gpt2(hf_config, seq_length, common)
        state = gpt2_state_dict_to_ours(_read_hf_tensors(hf_dir), config)
    elif arch == "gpt_neox":
        config = _model_config_from_neox(hf_config, seq_length, common)
        state = neox_state_dict_to_ours(_read_hf_tensors(hf_dir), config)
    elif arch in LLAMA_FAMILY:
        config = model_config_from_llama(hf_config, seq_length or hf_config.max_position_embeddings, **common)
        state = llama_state_dict_to_ours(_read_hf_tensors(hf_dir), config)
    elif arch in MOE_FAMILY:
        config = model_config_from_moe(hf_config, seq_length or hf_config.max_position_embeddings, **common)
        state = moe_state_dict_to_ours(_read_hf_tensors(hf_dir), config)
    elif arch in DEEPSEEK_V3:
        config = model_config_from_deepseek(hf_config, seq_length or hf_config.max_position_embeddings, **common)
        state = deepseek_state_dict_to_ours(_read_hf_tensors(hf_dir), config)
    else:
        raise ValueError(f"{hf_dir!r} holds a {arch!r} model; this converter reads bloom, gpt2, gpt_neox, "
                         f"{', '.join(LLAMA_FAMILY + tuple(MOE_FAMILY) + tuple(DEEPSEEK_V3))}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[params_dtype]
    fp32 = set(router_buffer_names(config))  # the expert biases stay fp32, as the routers keep them
    return config, {name: tensor.to(torch.float32 if name in fp32 else dtype).contiguous()
                    for name, tensor in state.items()}, arch


def _model_config_from_gpt2(hf_config, seq_length: Optional[int], common: dict) -> ModelConfig:
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} is not the tanh GeLU our MLP computes")
    if hf_config.scale_attn_by_inverse_layer_idx or not hf_config.scale_attn_weights:
        raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
    return ModelConfig(num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                       num_attention_heads=hf_config.n_head, seq_length=seq_length or hf_config.n_positions,
                       max_position_embeddings=hf_config.n_positions, ffn_hidden_size=hf_config.n_inner,
                       position_embedding_type="absolute", embed_layernorm=False,
                       layernorm_epsilon=hf_config.layer_norm_epsilon, hidden_dropout=hf_config.resid_pdrop,
                       attention_dropout=hf_config.attn_pdrop, init_method_std=hf_config.initializer_range,
                       **common).validate()


def export_tokenizer(record: dict, out_dir: str, model_max_length: Optional[int] = None) -> list[str]:
    """Write the checkpoint's tokenizer so that ``AutoTokenizer.from_pretrained(out_dir)`` loads it offline.

    record: the checkpoint's tokenizer record (type and file paths). GPT2BPETokenizer: vocab.json,
    merges.txt and a tokenizer.json built with the ``tokenizers`` library; PretrainedFromHF: its
    tokenizer.json; SentencePieceTokenizer: the .model file is copied as tokenizer.model. Returns the
    files written; [] when the record names no existing files.
    """
    kind = record.get("tokenizer_type")
    written: list[str] = []
    if kind == "GPT2BPETokenizer" and all(record.get(k) and os.path.isfile(record[k])
                                          for k in ("vocab_file", "merge_file")):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 (tokenizers: only when a tokenizer is exported)

        tokenizer = Tokenizer(models.BPE.from_file(record["vocab_file"], record["merge_file"]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
        shutil.copyfile(record["vocab_file"], os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(record["merge_file"], os.path.join(out_dir, "merges.txt"))
        tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
        written = ["vocab.json", "merges.txt", "tokenizer.json"]
        special = "<|endoftext|>"
    elif kind == "PretrainedFromHF" and record.get("tokenizer_name_or_path"):
        path = record["tokenizer_name_or_path"]
        source = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(source):
            return []
        shutil.copyfile(source, os.path.join(out_dir, "tokenizer.json"))
        written, special = ["tokenizer.json"], _eod_token_of(source)
    elif kind == "SentencePieceTokenizer" and record.get("tokenizer_model") and os.path.isfile(
            record["tokenizer_model"]):
        shutil.copyfile(record["tokenizer_model"], os.path.join(out_dir, "tokenizer.model"))
        return ["tokenizer.model"]
    else:
        return []
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": False, "clean_up_tokenization_spaces": False}
    if special is not None:
        config.update(eos_token=special, bos_token=special)
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return written + ["tokenizer_config.json"]


def _eod_token_of(tokenizer_json: str) -> Optional[str]:
    from tokenizers import Tokenizer  # noqa: PLC0415 (tokenizers: only when a tokenizer is exported)

    vocab = Tokenizer.from_file(tokenizer_json).get_vocab(with_added_tokens=True)
    return next((token for token in EOD_TOKEN_CANDIDATES if token in vocab), None)

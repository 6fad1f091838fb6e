"""Map full (TP=1) weights and configs between GPTModel and transformers' Bloom.

The layouts agree tensor for tensor, QKV included (rows ordered [heads, 3, hn] on both sides), so
the mapping is only a renaming, plus padding / trimming of the vocabulary rows. The output head is
tied: transformers' ``lm_head.weight`` is the word embedding.

    ours = bloom_state_dict_to_ours(hf_model.state_dict(), config)   # -> GPTModel.load_state_dict
    hf = ours_to_bloom_state_dict(model.state_dict(), config, vocab_size)   # -> BloomForCausalLM.load_state_dict

Which tensors there are comes from ``megatron.model.layout``; this file only renames them.
Nothing here imports transformers; the config helpers take / return plain attribute holders.
Shapes: v vocabulary, h hidden.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from megatron.config import ModelConfig
from megatron.model.layout import parameter_layout

__all__ = ["MODEL_TYPES", "bloom_state_dict_to_ours", "ours_to_bloom_state_dict", "model_config_from_bloom",
           "bloom_config_kwargs", "bloom_name"]

MODEL_TYPES = {"bloom": ("BloomConfig", "BloomForCausalLM")}  # model_type -> (config class, model class)

# Our GPTModel name prefix -> transformers' Bloom name prefix (inside ``transformer.``); the names
# themselves come from megatron.model.layout, so a parameter the layout gains must be mapped here.
_PREFIXES = (("embedding.word_embeddings.", "word_embeddings."),
             ("embedding.embed_layernorm.", "word_embeddings_layernorm."),
             ("layers.", "h."),
             ("final_layernorm.", "ln_f."))


def bloom_name(name: str) -> str:
    """transformers' Bloom name (without ``transformer.``) of one of our GPTModel parameters."""
    for ours, theirs in _PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise ValueError(f"{name!r} has no counterpart in transformers' Bloom (ALiBi, embedding LayerNorm, tied head)")


def _name_pairs(config: ModelConfig) -> list[tuple[str, str]]:
    """(Bloom name, our name) of every parameter of ``config``'s GPTModel."""
    return [(bloom_name(name), name) for name in parameter_layout(config)]


def _num_layers(names, pattern: str) -> int:
    indices = {int(m.group(1)) for name in names if (m := re.match(pattern, name))}
    if indices != set(range(len(indices))):
        raise ValueError(f"layer indices {sorted(indices)} are not 0 .. n-1")
    return len(indices)


def bloom_state_dict_to_ours(bloom_state: dict[str, torch.Tensor], config: ModelConfig
                             ) -> dict[str, torch.Tensor]:
    """A transformers ``BloomForCausalLM`` / ``BloomModel`` state dict -> a TP=1 GPTModel state dict.

    The word embedding is zero-padded to ``config.padded_vocab_size`` rows. A separate
    ``lm_head.weight`` must equal the word embedding (our head is tied).
    """
    state = {name.removeprefix("transformer."): tensor for name, tensor in bloom_state.items()}
    lm_head = state.pop("lm_head.weight", None)
    num_layers = _num_layers(state, r"h\.(\d+)\.")
    if num_layers != config.num_layers:
        raise ValueError(f"the Bloom state dict has {num_layers} layers, the config num_layers {config.num_layers}")
    pairs = _name_pairs(config)
    missing = [hf for hf, _ in pairs if hf not in state]
    unknown = sorted(set(state) - {hf for hf, _ in pairs})
    if missing or unknown:
        raise ValueError(f"not a Bloom state dict we can map: missing {missing}, unexpected {unknown}")
    ours = {mine: state[hf] for hf, mine in pairs}

    words = ours["embedding.word_embeddings.weight"]  # [v, h]
    if lm_head is not None and not torch.equal(lm_head, words):
        raise ValueError("lm_head.weight differs from word_embeddings.weight; GPTModel ties them")
    vocab_size, padded = words.shape[0], config.padded_vocab_size
    if vocab_size > padded:
        raise ValueError(f"the Bloom vocabulary has {vocab_size} rows, more than padded_vocab_size {padded}")
    if vocab_size < padded:
        padding = words.new_zeros(padded - vocab_size, words.shape[1])  # [padded - v, h]
        ours["embedding.word_embeddings.weight"] = torch.cat((words, padding), dim=0)  # [padded, h]
    return ours


def ours_to_bloom_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, vocab_size: Optional[int] = None,
                             with_lm_head: bool = True) -> dict[str, torch.Tensor]:
    """A TP=1 GPTModel state dict of ``config`` -> a transformers ``BloomForCausalLM`` state dict.

    vocab_size: keep only the first rows of the word embedding (drop our padding); default all.
    with_lm_head: also emit ``lm_head.weight`` (the tied word embedding).
    """
    unsupported = [name for name in state if "position_embeddings" in name]
    if unsupported or config.position_embedding_type != "alibi":
        raise ValueError(f"Bloom has no learned positions (ALiBi only), but the model has position_embedding_type "
                         f"{config.position_embedding_type!r} ({unsupported or 'no such tensors'})")
    pairs = _name_pairs(config)
    missing = [mine for _, mine in pairs if mine not in state]
    unknown = sorted(set(state) - {mine for _, mine in pairs})
    if missing or unknown:
        raise ValueError(f"not a GPTModel state dict of this Bloom configuration: missing {missing}, "
                         f"unexpected {unknown}")
    bloom = {"transformer." + hf: state[mine] for hf, mine in pairs}
    words = bloom["transformer.word_embeddings.weight"]  # [padded, h]
    if vocab_size is not None:
        if vocab_size > words.shape[0]:
            raise ValueError(f"vocab_size {vocab_size} is larger than the {words.shape[0]} embedding rows")
        bloom["transformer.word_embeddings.weight"] = words = words[:vocab_size]  # [v, h]
    if with_lm_head:
        bloom["lm_head.weight"] = words
    return bloom


def model_config_from_bloom(bloom_config: Any, seq_length: int, **overrides) -> ModelConfig:
    """A ModelConfig for a transformers ``BloomConfig`` (ALiBi, embedding LayerNorm, ffn = 4h).

    seq_length: the training / inference length (Bloom's config does not record one).
    overrides: any other ModelConfig field, e.g. padded_vocab_size or params_dtype.
    """
    if getattr(bloom_config, "apply_residual_connection_post_layernorm", False):
        raise ValueError("apply_residual_connection_post_layernorm=True is not supported (pre-LN residual only)")
    fields = dict(num_layers=bloom_config.n_layer, hidden_size=bloom_config.hidden_size,
                  num_attention_heads=bloom_config.n_head, padded_vocab_size=bloom_config.vocab_size,
                  seq_length=seq_length, position_embedding_type="alibi", embed_layernorm=True,
                  layernorm_epsilon=bloom_config.layer_norm_epsilon,
                  hidden_dropout=bloom_config.hidden_dropout, attention_dropout=bloom_config.attention_dropout,
                  init_method_std=bloom_config.initializer_range)
    fields.update(overrides)
    return ModelConfig(**fields).validate()


def bloom_config_kwargs(config: ModelConfig, vocab_size: Optional[int] = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.BloomConfig`` describing ``config``.

    vocab_size: the exported vocabulary (default: original_vocab_size, else padded_vocab_size).
    """
    if config.position_embedding_type != "alibi" or not config.embed_layernorm:
        raise ValueError(f"Bloom means ALiBi with an embedding LayerNorm, got position_embedding_type "
                         f"{config.position_embedding_type!r} and embed_layernorm {config.embed_layernorm}")
    if config.ffn_size != 4 * config.hidden_size:
        raise ValueError(f"Bloom's MLP is 4 * hidden = {4 * config.hidden_size} wide, got ffn size {config.ffn_size}")
    if vocab_size is None:
        vocab_size = config.original_vocab_size or config.padded_vocab_size
    return dict(vocab_size=vocab_size, hidden_size=config.hidden_size, n_layer=config.num_layers,
                n_head=config.num_attention_heads, layer_norm_epsilon=config.layernorm_epsilon,
                initializer_range=config.init_method_std, hidden_dropout=config.hidden_dropout,
                attention_dropout=config.attention_dropout, apply_residual_connection_post_layernorm=False,
                tie_word_embeddings=True)

"""Transformers model directories: our full (TP=1) weights and config <-> ``config.json`` + safetensors, tokenizers.

    write_hf_model(config, state_dict, out_dir, pretraining_tp=..., eos_token_id=...)  -> config.json, model.safetensors
    config, state_dict, model_type = read_hf_model(hf_dir, padded_vocab_size_fn=..., seq_length=...)
    export_tokenizer(record, out_dir)   the checkpoint's tokenizer, loadable by ``AutoTokenizer.from_pretrained``

Which family a model maps to, and the tensor and config mappings, come from ``megatron.checkpoint.hf.families``;
this module holds what every family shares: transformers' config classes (imported here only, when a directory
is written or read), safetensors files (one, or transformers' sharded layout with its index; a legacy
``pytorch_model.bin`` is read too), dtype names and the tokenizer files.

The vocabulary is trimmed to ``original_vocab_size`` on export and zero-padded to the padded size on
import: a zero row gives its (never real) token the logit 0 and leaves every real token's logit
unchanged; generation masks padded ids, and training quickly pushes their probability down.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from megatron.checkpoint.hf.families import family_for, family_of
from megatron.checkpoint.single_process import router_buffer_names
from megatron.config import ModelConfig
from megatron.data.tokenizers import EOD_TOKEN_CANDIDATES
from megatron.model.norm import effective_norm_weights

__all__ = ["write_hf_model", "read_hf_model", "export_tokenizer", "DTYPE_NAMES"]

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_hf_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], out_dir: str, *,
                   pretraining_tp: int = 1, eos_token_id: Optional[int] = None,
                   dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 << 30) -> str:
    """Write ``config.json`` + ``model.safetensors`` of the matching transformers model; return its architecture.

    The vocabulary is trimmed to ``config.original_vocab_size`` (the padding rows are ours only).
    pretraining_tp: the training TP, recorded in Bloom's config (``slow_but_exact`` stays False).
    max_shard_bytes: larger exports are split into transformers' sharded safetensors layout.
    """
    import transformers  # noqa: PLC0415 (transformers: seconds to import, only for an export or import)

    family, model_type = family_for(config)
    vocab_size = config.original_vocab_size or config.padded_vocab_size
    tensors = family.from_ours(effective_norm_weights(state_dict, config), config, vocab_size)
    if config.tied_embeddings:
        tensors.pop("lm_head.weight", None)  # transformers ties it to the embedding (one stored tensor)
    config_class, model_class = family.model_types[model_type]
    kwargs = family.config_kwargs(config, vocab_size)
    if family.records_training_tp:
        kwargs["pretraining_tp"] = pretraining_tp
    # None when the tokenizer is unknown (GPT-2's default 50256 would point outside a small vocabulary)
    hf_config = getattr(transformers, config_class)(**kwargs, eos_token_id=eos_token_id, bos_token_id=eos_token_id)
    hf_config.architectures = [model_class]
    if dtype is not None:
        tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    hf_config.dtype = DTYPE_NAMES[next(iter(tensors.values())).dtype]
    os.makedirs(out_dir, exist_ok=True)
    hf_config.save_pretrained(out_dir)
    _save_safetensors(tensors, out_dir, max_shard_bytes)
    return model_type


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
    """(ModelConfig, TP=1 GPTModel state dict, model_type) of a local transformers directory of any family
    ``megatron.checkpoint.hf.families`` lists.

    padded_vocab_size_fn: vocab size -> padded size (Megatron's rule for the target TP).
    seq_length: the training length to record (default: the family's ``default_seq_length``: 2048 for Bloom,
        n_positions for GPT-2, max_position_embeddings for the others).
    """
    import transformers  # noqa: PLC0415 (transformers: seconds to import, only for an export or import)

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    arch = hf_config.model_type
    vocab = hf_config.vocab_size
    common = dict(padded_vocab_size=padded_vocab_size_fn(vocab), original_vocab_size=vocab,
                  params_dtype=params_dtype, seed=seed)
    try:
        family = family_of(arch)
    except ValueError as unknown:
        raise ValueError(f"{hf_dir!r} holds {unknown}") from None
    config = family.model_config(hf_config, seq_length or family.default_seq_length(hf_config), **common)
    tensors = _read_hf_tensors(hf_dir)
    config = family.fit_config(config, tensors)
    state = family.to_ours(tensors, config)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[params_dtype]
    fp32 = set(router_buffer_names(config))  # the expert biases stay fp32, as the routers keep them
    return config, {name: tensor.to(torch.float32 if name in fp32 else dtype).contiguous()
                    for name, tensor in state.items()}, arch


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
    elif kind in ("PretrainedFromHF", "HuggingFaceTokenizer") and record.get(
            "tokenizer_name_or_path" if kind == "PretrainedFromHF" else "tokenizer_model"):
        path = record["tokenizer_name_or_path" if kind == "PretrainedFromHF" else "tokenizer_model"]
        source = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(source):
            return []
        shutil.copyfile(source, os.path.join(out_dir, "tokenizer.json"))
        written, special = ["tokenizer.json"], _eod_token_of(source)
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer") and record.get(
            "tokenizer_model") and os.path.isfile(
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

"""Where tokens come from: data paths and blends, BLOOM's weighted split groups, the tokenizer."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config._checks import _one_of, _positive

# Megatron-DeepSpeed's and Megatron-LM's --tokenizer-type names read here (megatron.data.tokenizers); both
# upstreams default to GPT2BPETokenizer.
TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "PretrainedFromHF")
DEFAULT_TOKENIZER_TYPE = "GPT2BPETokenizer"
DATA_IMPLS = ("mmap", "infer")   # Megatron's "lazy" and "cached" formats are not read by this project


@dataclasses.dataclass(frozen=True)
class DatasetSplit:
    """One dataset of a weighted-split group: blend ``weight`` of documents [start, end) of ``prefix``."""

    weight: float
    start: float       # fraction of the dataset's documents, 0 <= start < end <= 1
    end: float
    prefix: str        # path without .bin / .idx


@dataclasses.dataclass(frozen=True)
class DatasetGroup:
    """A named blend (``"NAME: W START:END PATH, ..."``); each validation group is evaluated on its own."""

    name: str
    datasets: tuple[DatasetSplit, ...]


# The flags (TokenizerConfig fields) naming each type's files.
TOKENIZER_FILES = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "SentencePieceTokenizer": ("tokenizer_model",),
                    "GPTSentencePieceTokenizer": ("tokenizer_model",), "Llama2Tokenizer": ("tokenizer_model",),
                    "HuggingFaceTokenizer": ("tokenizer_model",), "PretrainedFromHF": ("tokenizer_name_or_path",)}


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer, from which files: the --tokenizer-type flags, what preprocessing workers
    rebuild, and what a checkpoint records (``run_state.json``'s "tokenizer"), in one shape."""

    tokenizer_type: Optional[str] = None            # one of TOKENIZER_TYPES
    vocab_file: Optional[str] = None                # GPT2BPETokenizer: vocab.json
    merge_file: Optional[str] = None                # GPT2BPETokenizer: merges.txt
    tokenizer_model: Optional[str] = None           # the SentencePiece types: the .model file; HuggingFaceTokenizer:
                                                    # a local tokenizer folder or tokenizer.json (or a cached hub name)
    tokenizer_name_or_path: Optional[str] = None    # PretrainedFromHF: a local tokenizer.json or directory, or a
                                                    # hub name in the local Hugging Face cache (megatron.data.hf_cache)

    @classmethod
    def from_record(cls, record: Optional[dict], **overrides) -> "TokenizerConfig":
        """From a checkpoint's record (unknown keys ignored), with the non-None ``overrides`` on top."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in (record or {}).items() if k in known and v is not None}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def validate(self) -> "TokenizerConfig":
        _one_of("--tokenizer-type", self.tokenizer_type, TOKENIZER_TYPES)
        for name in TOKENIZER_FILES[self.tokenizer_type]:
            if getattr(self, name) is None:
                default = (f" ({DEFAULT_TOKENIZER_TYPE} is the default, as in Megatron; name another with "
                           "--tokenizer-type)" if self.tokenizer_type == DEFAULT_TOKENIZER_TYPE else "")
                raise ValueError(f"--tokenizer-type {self.tokenizer_type} needs --{name.replace('_', '-')}{default}")
        return self


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. Two exclusive modes, as in Megatron-DeepSpeed:

    1. ``data_path`` + ``split``: one blend split into train/valid/test by document ranges;
    2. weighted split groups: one train group, any number of valid and test groups.
    """

    data_path: tuple[tuple[float, str], ...] = ()   # (weight, prefix) pairs; a single prefix has weight 1.0
    split: Optional[str] = None                     # "969, 30, 1"-style proportions (mode 1 only)
    train_weighted_split_groups: tuple[DatasetGroup, ...] = ()
    valid_weighted_split_groups: tuple[DatasetGroup, ...] = ()
    test_weighted_split_groups: tuple[DatasetGroup, ...] = ()
    data_impl: str = "mmap"                         # only Megatron's mmap format is read
    data_cache_path: Optional[str] = None           # folder of the sample-index caches; None: beside the data
    seq_length: int = 1024                          # tokens per sample
    num_workers: int = 2                            # DataLoader workers for training
    valid_num_workers: int = 2                      # DataLoader workers for validation and test
    tokenizer: TokenizerConfig = TokenizerConfig()
    make_vocab_size_divisible_by: int = 128         # padding multiple (times TP) of the embedding rows
    pad_vocab_size_to: Optional[int] = None         # exact padded size instead (BLOOM: 250880)
    seed: int = 1234                                # sample-index shuffling seed
    eod_mask_loss: bool = False                     # no loss where the input token is end-of-document
    reset_position_ids: bool = False                # learned positions restart after each end-of-document
    reset_attention_mask: bool = False              # attention stays inside each document of a sample
    eod_token_id: Optional[int] = None              # the tokenizer's end-of-document id (resolve_vocab_size)

    @property
    def uses_weighted_splits(self) -> bool:
        return bool(self.train_weighted_split_groups or self.valid_weighted_split_groups
                    or self.test_weighted_split_groups)

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        """(train, valid, test) fractions of ``split``; Megatron pads missing parts with 0."""
        parts = [float(p) for p in (self.split or "969, 30, 1").replace("/", ",").split(",") if p.strip()]
        parts = (parts + [0.0, 0.0, 0.0])[:3]
        total = sum(parts)
        return tuple(p / total for p in parts)  # type: ignore[return-value]

    @property
    def has_validation_data(self) -> bool:
        if self.uses_weighted_splits:
            return bool(self.valid_weighted_split_groups)
        return bool(self.data_path) and self.split_fractions[1] > 0

    def validate(self) -> "DataConfig":
        if self.data_path and self.uses_weighted_splits:
            raise ValueError("--data-path and --(train|valid|test)-weighted-split-paths are exclusive ways to "
                             "name the data; pass one of them")
        if not self.data_path and not self.train_weighted_split_groups:
            raise ValueError("no training data: pass --data-path PREFIX (or WEIGHT PREFIX ...) or "
                             "--train-weighted-split-paths(-path)")
        if self.uses_weighted_splits and self.split is not None:
            raise ValueError(f"--split {self.split!r} applies to --data-path only; the weighted split paths "
                             "carry their own START:END ranges")
        if len(self.train_weighted_split_groups) > 1:
            raise ValueError(f"--train-weighted-split-paths takes exactly one group, got "
                             f"{len(self.train_weighted_split_groups)}")
        if self.split is not None:
            try:
                fractions = self.split_fractions
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"--split {self.split!r} must be up to three non-negative numbers with a "
                                 "positive sum, e.g. '969, 30, 1'") from None
            if min(fractions) < 0:
                raise ValueError(f"--split {self.split!r} has a negative part")
        if self.data_impl not in DATA_IMPLS:
            raise ValueError(f"--data-impl {self.data_impl!r} is not supported: this project reads Megatron's "
                             f"mmap format only (pass --data-impl mmap; convert with tools/preprocess_data.py)")
        _positive("--seq-length", self.seq_length)
        if self.num_workers < 0 or self.valid_num_workers < 0:
            raise ValueError(f"--num-workers {self.num_workers} and --valid-num-workers "
                             f"{self.valid_num_workers} must be >= 0")
        self._validate_tokenizer()
        return self

    def _validate_tokenizer(self) -> None:
        self.tokenizer.validate()
        _positive("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by)
        _positive("--pad-vocab-size-to", self.pad_vocab_size_to, allow_none=True)

"""DataConfig.validate: the two exclusive ways to name the data, the format, the tokenizer's files."""

import dataclasses

import pytest

from megatron.config import DataConfig, DatasetGroup, DatasetSplit, TokenizerConfig

GROUP = DatasetGroup("train", (DatasetSplit(1.0, 0.0, 0.9, "a"),))
VALID = DatasetGroup("valid", (DatasetSplit(1.0, 0.9, 1.0, "a"),))


TOKENIZER_FIELDS = {f.name for f in dataclasses.fields(TokenizerConfig)}


def data(**overrides) -> DataConfig:
    """The tiny data config with ``overrides``; tokenizer fields go to its TokenizerConfig."""
    tokenizer = TokenizerConfig("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    tokenizer = dataclasses.replace(tokenizer, **{k: v for k, v in overrides.items() if k in TOKENIZER_FIELDS})
    base = DataConfig(data_path=((1.0, "a"),), seq_length=32, tokenizer=tokenizer)
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if k not in TOKENIZER_FIELDS})


def test_split_fractions_and_validation_data():
    # Exact: each fraction is one correctly rounded division of integers (969 / 1000, their sum exact), the same
    # nearest double as the literal's.
    assert data().validate().split_fractions == (0.969, 0.030, 0.001)  # Megatron's default
    assert data(split="90,10").split_fractions == (0.9, 0.1, 0.0)
    assert not data(split="100,0,0").has_validation_data
    weighted = data(data_path=(), train_weighted_split_groups=(GROUP,)).validate()
    assert weighted.uses_weighted_splits and not weighted.has_validation_data
    assert data(data_path=(), train_weighted_split_groups=(GROUP,), valid_weighted_split_groups=(VALID,)
                ).validate().has_validation_data


@pytest.mark.parametrize("overrides,words", [
    (dict(train_weighted_split_groups=(GROUP,)), "--data-path and --(train|valid|test)-weighted-split-paths are "
                                                 "exclusive"),
    (dict(data_path=()), "no training data"),
    (dict(data_path=(), train_weighted_split_groups=(GROUP,), split="90,10,0"), "--split '90,10,0' applies to "
                                                                              "--data-path only"),
    (dict(data_path=(), train_weighted_split_groups=(GROUP, GROUP)), "takes exactly one group, got 2"),
    (dict(split="a,b"), "--split 'a,b' must be up to three non-negative numbers"),
    (dict(split="100,-5,5"), "--split '100,-5,5' has a negative part"),
    (dict(data_impl="lazy"), "--data-impl 'lazy' is not supported: this project reads Megatron's mmap format"),
    (dict(num_workers=-1), "--num-workers -1 and --valid-num-workers 2 must be >= 0"),
    (dict(tokenizer_type="BertWordPiece"), "--tokenizer-type 'BertWordPiece' is not one of"),
    (dict(merge_file=None), "--tokenizer-type GPT2BPETokenizer needs --merge-file"),
    (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-type SentencePieceTokenizer needs "
                                                    "--tokenizer-model"),
    (dict(tokenizer_type="PretrainedFromHF"), "--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path"),
    (dict(pad_vocab_size_to=0), "--pad-vocab-size-to must be a positive integer, got 0"),
])
def test_impossible_data_is_rejected(overrides, words):
    with pytest.raises(ValueError) as info:
        data(**overrides).validate()
    assert words in str(info.value)


def test_a_checkpoints_tokenizer_record_round_trips_with_overrides():
    config = TokenizerConfig("GPT2BPETokenizer", vocab_file="v.json", merge_file="m.txt")
    record = dataclasses.asdict(config)  # what run_state.json holds
    assert TokenizerConfig.from_record(record) == config
    assert TokenizerConfig.from_record(dict(record, unknown_key=1), vocab_file="w.json", merge_file=None) == \
        dataclasses.replace(config, vocab_file="w.json")  # None overrides nothing
    assert TokenizerConfig.from_record(None).tokenizer_type is None

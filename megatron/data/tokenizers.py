"""Tokenizers behind one interface, and Megatron's vocabulary padding.

The implementations, named as Megatron-DeepSpeed's and Megatron-LM's ``--tokenizer-type`` name them
(both upstreams default to ``GPT2BPETokenizer``):

- ``GPT2BPETokenizer``: byte-level BPE from a GPT-2 ``vocab.json`` + ``merges.txt``, through the
  ``tokenizers`` library (a byte-level pre-tokenizer without a prefix space, exactly as GPT-2 and
  Megatron's own BPE code split text); ``<|endoftext|>`` is the end-of-document token.
- ``SentencePieceTokenizer`` and Megatron-DeepSpeed's ``GPTSentencePieceTokenizer`` (the same here): a
  SentencePiece ``.model`` file (``--tokenizer-model``); ``</s>`` (its eos) ends a document.
- ``Llama2Tokenizer`` (Megatron-LM): a SentencePiece ``.model`` file whose ``tokenize`` puts the BOS
  token first, as Megatron-LM's does (so ``tools/preprocess_data.py`` writes what Megatron-LM's writes).
- ``HuggingFaceTokenizer`` (Megatron-LM): ``--tokenizer-model`` names a local tokenizer folder or
  ``tokenizer.json`` (or a hub name in the local cache); ``tokenize`` adds the tokenizer's own special
  tokens (Llama 3's ``<|begin_of_text|>``), as Megatron-LM's does; the eos token of the folder's
  ``tokenizer_config.json`` ends a document.
- ``PretrainedFromHF`` (BLOOM's Megatron-DeepSpeed): a LOCAL ``tokenizer.json`` or a local directory
  holding one (or any local directory ``transformers`` can load with ``local_files_only=True``), or a
  hub name already in the local Hugging Face cache (``megatron.data.hf_cache``). Nothing here downloads.

Apart from those two upstream rules (Llama2Tokenizer's BOS, HuggingFaceTokenizer's special tokens), no
tokenizer adds special tokens of its own: a document's end-of-document token is appended by the caller
(``tools/preprocess_data.py --append-eod``), as in Megatron.
"""

from __future__ import annotations

import abc
import json
import os
import pathlib
from typing import Iterable, Iterator, Optional, Sequence

from megatron.config.data import TOKENIZER_TYPES, TokenizerConfig  # the --tokenizer-type names: defined there
from megatron.data.hf_cache import resolve_tokenizer_path

# Names of an end-of-document token, most specific first; PretrainedFromHF takes the first present.
EOD_TOKEN_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
PAD_TOKEN_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")

# Texts longer than this (characters) are tokenized in pieces by tokenizers that allow it
# (``cuts_before_spaces``): one 50 MB document tokenized whole takes about 120x its size in memory.
LONG_TEXT_CHARS = 1 << 18


class AbstractTokenizer(abc.ABC):
    """What the data pipeline and the model need from a tokenizer."""

    name: str = "abstract"

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Tokens in the vocabulary before any padding (see ``pad_vocab_size``)."""

    # True where tokenizing a text in pieces, each cut just before a space that follows a non-space,
    # gives exactly the ids of the whole text: byte-level BPE with GPT-2's pre-tokenization, whose
    # pre-tokens (letters, digits or punctuation with at most one leading space, and whitespace runs)
    # never span such a point, and no normalizer. See ``tokenize_long``.
    cuts_before_spaces: bool = False

    # The local folder the tokenizer was loaded from, where a ``tokenizer_config.json`` (and its chat
    # template) may be; None for tokenizers given as files.
    directory: Optional[pathlib.Path] = None

    # Set by each implementation's __init__.
    _eod: int
    _pad: Optional[int] = None

    @property
    def eod(self) -> int:
        """Id of the end-of-document token appended to each document."""
        return self._eod

    @property
    def pad(self) -> int:
        """Id used for padding; the end-of-document id where the vocabulary has no pad token."""
        return self._eod if self._pad is None else self._pad

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text -> token ids, no special tokens added."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids -> text."""

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once; implementations override this with their library's batch call."""
        return [self.tokenize(text) for text in texts]

    def tokenize_long(self, text: str, piece_chars: int = LONG_TEXT_CHARS) -> Iterator[list[int]]:
        """The ids of ``text`` in consecutive parts, whose concatenation is ``tokenize(text)``; with
        ``cuts_before_spaces``, memory is bounded by ``piece_chars`` instead of the text's length (a text
        without a space to cut at stays one piece)."""
        if not self.cuts_before_spaces:
            yield self.tokenize(text)
            return
        for piece in pieces_before_spaces(text, piece_chars):
            yield self.tokenize(piece)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


class _FastTokenizer(AbstractTokenizer):
    """Shared code for tokenizers backed by a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer, eod: int, pad: Optional[int] = None):
        self._tokenizer = tokenizer
        self._eod = eod
        self._pad = eod if pad is None else pad

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer`` (for fast batch work in preprocessing)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast skips computing character offsets, which nothing here needs (~10% faster).
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def pieces_before_spaces(text: str, piece_chars: int) -> Iterator[str]:
    """``text`` in consecutive pieces of at least ``piece_chars`` characters (the last may be shorter),
    each after the first starting at a space whose preceding character is not whitespace."""
    start = 0
    while len(text) - start > piece_chars:
        cut = text.find(" ", start + piece_chars)
        while cut > 0 and text[cut - 1].isspace():  # str.isspace covers all of Unicode's White_Space
            cut = text.find(" ", cut + 1)
        if cut < 0:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _cuts_before_spaces(tokenizer) -> bool:
    """Whether a ``tokenizers.Tokenizer`` (from a tokenizer.json) is GPT-2-style byte-level BPE: no
    normalizer, the byte-level pre-tokenizer with GPT-2's split and no prefix space, and no added
    token with whitespace in it (added tokens are matched before pre-tokenization)."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space", True) and pre.get("use_regex", True)
            and not any(any(c.isspace() for c in t.get("content", "")) for t in spec.get("added_tokens", [])))


def _require_file(path, flag: str) -> str:
    if path is None:
        raise ValueError(f"{flag} is required for this tokenizer type; pass the path of the file")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is not a file; pass the path of an existing file")
    return os.fspath(path)


class GPT2BPETokenizer(_FastTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``; ``<|endoftext|>`` ends a document.

    ``<|endoftext|>`` written inside a text is NOT turned into the special id (it is split like any
    other text), which is what Megatron's GPT-2 tokenizer does and what keeps the output of
    ``tools/preprocess_data.py`` byte-identical to Megatron's.
    """

    name = "GPT2BPETokenizer"
    cuts_before_spaces = True

    def __init__(self, vocab_file, merge_file):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 (optional: only for that tokenizer type)

        vocab_file = _require_file(vocab_file, "--vocab-file")
        merge_file = _require_file(merge_file, "--merge-file")
        tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        eod = tokenizer.token_to_id("<|endoftext|>")
        if eod is None:
            raise ValueError(f"vocabulary {vocab_file!r} has no '<|endoftext|>' token; GPT2BPETokenizer "
                             "needs it as the end-of-document token")
        super().__init__(tokenizer, eod)


class SentencePieceTokenizer(AbstractTokenizer):
    """A SentencePiece model; its eos (``</s>``) ends a document, its pad (if any) pads."""

    name = "SentencePieceTokenizer"
    add_bos = False  # Llama2Tokenizer: put the model's BOS first

    def __init__(self, model_file):
        import sentencepiece  # noqa: PLC0415 (optional: only for that tokenizer type)

        model_file = _require_file(model_file, "--tokenizer-model")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            raise ValueError(f"SentencePiece model {model_file!r} has no eos token; train it with eos_id >= 0")
        pad = self._sp.pad_id()
        self._pad = pad if pad >= 0 else self._eod

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, add_bos=self.add_bos)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One thread: preprocessing parallelizes over worker processes instead.
        return self._sp.encode(list(texts), add_bos=self.add_bos, num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron-DeepSpeed's name for a plain SentencePiece model (its Llama examples use it)."""

    name = "GPTSentencePieceTokenizer"


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's Llama-2 tokenizer: SentencePiece, BOS first in every ``tokenize``, eos ends a document."""

    name = "Llama2Tokenizer"
    add_bos = True

    def __init__(self, model_file):
        super().__init__(model_file)
        if self._sp.bos_id() < 0:
            raise ValueError(f"SentencePiece model {model_file!r} has no bos token, which Llama2Tokenizer puts "
                             "first; use --tokenizer-type GPTSentencePieceTokenizer for a model without one")


def _special_id(vocab: dict, candidates: Sequence[str]) -> Optional[int]:
    for token in candidates:
        if token in vocab:
            return vocab[token]
    return None


class PretrainedFromHF(_FastTokenizer):
    """A tokenizer on local disk: a ``tokenizer.json`` file, a directory holding one, or the snapshot
    folder of a hub name in the local Hugging Face cache (``resolve_tokenizer_path``; no download).

    A directory without ``tokenizer.json`` is handed to ``transformers.AutoTokenizer`` with
    ``local_files_only=True``.
    """

    name = "PretrainedFromHF"
    flag = "--tokenizer-name-or-path"
    add_special_tokens = False   # HuggingFaceTokenizer: the tokenizer's own BOS (and any other it adds)

    def __init__(self, name_or_path):
        if name_or_path is None:
            raise ValueError(f"{self.flag} is required for {self.name}; pass a local "
                             "tokenizer.json, a directory holding one, or a hub name in the local cache")
        path = pathlib.Path(resolve_tokenizer_path(name_or_path))
        self.directory = path if path.is_dir() else None
        json_file = path / "tokenizer.json" if path.is_dir() else path
        if json_file.is_file():
            from tokenizers import Tokenizer  # noqa: PLC0415 (optional: only for that tokenizer type)

            tokenizer = Tokenizer.from_file(str(json_file))
            vocab = tokenizer.get_vocab(with_added_tokens=True)
            eod = _special_id(vocab, self._eod_candidates(json_file.parent))
            if eod is None:
                raise ValueError(f"{str(json_file)!r} has none of the end-of-document tokens "
                                 f"{EOD_TOKEN_CANDIDATES}; add one of them to the tokenizer")
            super().__init__(tokenizer, eod, _special_id(vocab, PAD_TOKEN_CANDIDATES))
            self._hf = None
            # pieces of a text would each get the special tokens: only whole texts then
            self.cuts_before_spaces = _cuts_before_spaces(tokenizer) and not self.add_special_tokens
        else:
            self._init_transformers(path)

    def _eod_candidates(self, folder: pathlib.Path) -> tuple[str, ...]:
        """The end-of-document names to look for, most specific first."""
        return EOD_TOKEN_CANDIDATES

    def _init_transformers(self, path: pathlib.Path) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415 (transformers: seconds to import, only for --tokenizer-type HFTokenizer)

        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        # transformers 5 can "load" a directory whose vocabulary files it does not understand as an
        # empty tokenizer that encodes everything to []: refuse it instead of writing empty data.
        if len(hf) < 2 or not hf("probe text", add_special_tokens=False)["input_ids"]:
            raise ValueError(f"transformers loaded {str(path)!r} as an empty tokenizer (vocabulary "
                             f"{len(hf)}); save it with a tokenizer.json (tokenizers.Tokenizer.save)")
        if hf.eos_token_id is None:
            raise ValueError(f"tokenizer at {str(path)!r} has no eos token; set one (it ends documents)")
        self._hf = hf
        self._tokenizer = None
        self._eod = hf.eos_token_id
        self._pad = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id

    @property
    def backend(self):
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self._hf) if self._hf is not None else super().vocab_size

    def tokenize(self, text: str) -> list[int]:
        if self._hf is not None:
            return self._hf(text, add_special_tokens=self.add_special_tokens)["input_ids"]
        return self._tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._hf is not None:
            return self._hf(list(texts), add_special_tokens=self.add_special_tokens)["input_ids"]
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(list(texts), add_special_tokens=self.add_special_tokens)]

    def detokenize(self, ids: Sequence[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(list(ids))
        return super().detokenize(ids)


class HuggingFaceTokenizer(PretrainedFromHF):
    """Megatron-LM's ``HuggingFaceTokenizer``: the tokenizer folder (or tokenizer.json) ``--tokenizer-model``
    names; ``tokenize`` adds the tokenizer's own special tokens (Llama 3's BOS), as Megatron-LM's does; its
    eos token (``tokenizer_config.json``'s ``eos_token``, else the usual names) ends a document."""

    name = "HuggingFaceTokenizer"
    flag = "--tokenizer-model"
    add_special_tokens = True

    def _eod_candidates(self, folder: pathlib.Path) -> tuple[str, ...]:
        config = folder / "tokenizer_config.json"
        eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        return ((eos,) if isinstance(eos, str) else ()) + EOD_TOKEN_CANDIDATES


def build_tokenizer(config: TokenizerConfig) -> AbstractTokenizer:
    """The tokenizer named by Megatron's ``--tokenizer-type``, from the files its flags name."""
    if config.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(config.vocab_file, config.merge_file)
    sentencepiece_types = {cls.name: cls for cls in (SentencePieceTokenizer, GPTSentencePieceTokenizer,
                                                     Llama2Tokenizer)}
    if config.tokenizer_type in sentencepiece_types:
        return sentencepiece_types[config.tokenizer_type](config.tokenizer_model)
    if config.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(config.tokenizer_model)
    if config.tokenizer_type == "PretrainedFromHF":
        return PretrainedFromHF(config.tokenizer_name_or_path)
    raise ValueError(f"--tokenizer-type {config.tokenizer_type!r} is not supported; use one of {TOKENIZER_TYPES}")


def pad_vocab_size(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                   tensor_model_parallel_size: int = 1, pad_vocab_size_to: Optional[int] = None) -> int:
    """Rows of the word embedding: the vocabulary padded so every TP rank holds an equal, aligned slice.

    Megatron's rule: round ``orig_vocab_size`` up to a multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size``. With ``pad_vocab_size_to`` (BLOOM's
    250,880) that exact size is used instead; it must hold the vocabulary and split evenly over TP.
    """
    if orig_vocab_size <= 0 or make_vocab_size_divisible_by <= 0 or tensor_model_parallel_size <= 0:
        raise ValueError(f"vocabulary size {orig_vocab_size}, make_vocab_size_divisible_by "
                         f"{make_vocab_size_divisible_by} and tensor_model_parallel_size "
                         f"{tensor_model_parallel_size} must all be positive")
    if pad_vocab_size_to is not None:
        if pad_vocab_size_to < orig_vocab_size:
            raise ValueError(f"pad_vocab_size_to={pad_vocab_size_to} is smaller than the tokenizer's "
                             f"vocabulary of {orig_vocab_size}; pass a size >= {orig_vocab_size}")
        if pad_vocab_size_to % tensor_model_parallel_size != 0:
            raise ValueError(f"pad_vocab_size_to={pad_vocab_size_to} is not divisible by "
                             f"tensor_model_parallel_size={tensor_model_parallel_size}; pass a multiple "
                             f"of {tensor_model_parallel_size}")
        return pad_vocab_size_to
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple



def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, output_dir, eod_token: str = "<|endoftext|>",
                        min_frequency: int = 2) -> dict:
    """Train a GPT-2-style byte-level BPE on ``texts``; write ``vocab.json``, ``merges.txt`` and
    ``tokenizer.json`` into ``output_dir`` and return their paths.

    The files load as ``GPT2BPETokenizer(vocab.json, merges.txt)`` and as
    ``PretrainedFromHF(tokenizer.json)``; both encode ordinary text identically, ``eod_token`` is the
    end-of-document token (id 0). The trainer is deterministic for the same texts in the same order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415 (optional: only for that tokenizer type)

    if vocab_size < 256 + 1:
        raise ValueError(f"vocab_size={vocab_size} cannot hold the 256 byte tokens plus {eod_token!r}; "
                         "pass at least 257")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[eod_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(output_dir, exist_ok=True)
    tokenizer_json = os.path.join(output_dir, "tokenizer.json")
    tokenizer.save(tokenizer_json)
    vocab_file, merge_file = tokenizer.model.save(os.fspath(output_dir))
    return {"vocab_file": vocab_file, "merge_file": merge_file, "tokenizer_json": tokenizer_json}


def _lines_of(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for line in text.splitlines():
            if line.strip():
                yield line


def train_sentencepiece_tokenizer(texts: Iterable[str], vocab_size: int, output_dir,
                                  model_type: str = "unigram") -> dict:
    """Train a SentencePiece model (``tokenizer.model``, ``tokenizer.vocab``) in ``output_dir``.

    Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (end of document), 3 ``<pad>``; unknown characters fall
    back to bytes. Texts are fed line by line (SentencePiece drops "sentences" longer than 4 kB),
    on one thread and unshuffled, so the same texts give the same model.
    """
    import sentencepiece  # noqa: PLC0415 (optional: only for that tokenizer type)

    os.makedirs(output_dir, exist_ok=True)
    prefix = os.path.join(os.fspath(output_dir), "tokenizer")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_lines_of(texts), model_prefix=prefix, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, byte_fallback=True, hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=1, shuffle_input_sentence=False,
        input_sentence_size=0, minloglevel=2)
    return {"tokenizer_model": prefix + ".model", "vocab": prefix + ".vocab"}

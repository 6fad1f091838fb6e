"""Our GPTModel as a model of EleutherAI's lm-evaluation-harness (lm-eval 0.4.x), registered as "megatron".

    lm = MegatronLM(model, tokenizer, model_config, batch_size=8)   # a TP=1 model, or this rank's TP part
    lm = MegatronLM.from_checkpoint("CKPT")                          # any TP / PP, merged (tools/generate.py's load)
    lm_eval.simple_evaluate(model=lm, tasks=[...])

It scores the way the harness's own Hugging Face backend (``lm_eval.models.huggingface.HFLM``) does, so
that the two give the same numbers for the same weights:
- ``loglikelihood``: context + continuation, cut from the left to ``max_length + 1`` tokens, the last one
  dropped; an empty context is the end-of-document token (``prefix_token_id``). The continuation's log
  probabilities are summed; "greedy" is whether every continuation token is the argmax.
- ``loglikelihood_rolling``: the harness's rolling windows of ``max_length`` tokens (the first predicted
  from the end-of-document token), each token predicted once, summed per text.
- ``generate_until``: batched greedy (or sampled) decoding with the KV cache
  (``megatron.inference.batching``), stopping at any of ``until``, the end-of-document token or
  ``max_gen_toks``; the context is cut from the left to ``max_length - max_gen_toks`` tokens.
Scores are fp32 log-softmaxes over the tokenizer's ``vocab_size`` rows only: the padding rows of the
embedding (ids >= original_vocab_size) are never scored, nor generated.

Requests go in batches of ``batch_size``, longest first, right-padded (a padded position sits after every
real one of its row, where the causal mask keeps it from changing them).

Tensor parallelism: every rank of the model's TP group runs the harness on the same requests in the same
order (the harness sees one process: ``rank`` 0, ``world_size`` 1), so the forwards' collectives pair up; the
logits are gathered to the full vocabulary on every rank. Only rank 0 should write results.

Shape letters: s sequence, b batch (requests), v vocabulary (unpadded), vp padded vocabulary.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.config import ModelConfig
from megatron.inference.batching import BatchDecoder, BatchRunner, GeneratingSequence
from megatron.inference.generation import Generator, SamplingParams, sequence_generator
from megatron.parallel.mappings import gather_from_tensor_model_parallel_region

__all__ = ["MegatronLM", "default_max_length", "load_for_evaluation"]

DEFAULT_MAX_GEN_TOKS = 256  # the harness's HFLM default


def default_max_length(config: ModelConfig) -> int:
    """Tokens one forward may hold: the learned positions (absolute), else the training length; what the
    harness's HFLM resolves for our to_hf.py export (n_positions / max_position_embeddings / the tokenizer's
    model_max_length, which to_hf.py writes as the training length)."""
    return config.max_positions if config.position_embedding_type == "absolute" else config.seq_length


def load_for_evaluation(load: str, *, tag: Optional[str] = None, dtype: str = "fp32", parallel_state=None,
                        **tokenizer_overrides) -> Generator:
    """The checkpoint's model and tokenizer (``Generator.from_checkpoint``), with a tokenizer that cannot be
    built (files moved, or none recorded) reported as one ValueError naming the checkpoint and the fix."""
    try:
        return Generator.from_checkpoint(load, tag=tag, dtype=dtype, parallel_state=parallel_state,
                                         **tokenizer_overrides)
    except ValueError as error:
        if "tokenizer" not in str(error) and "file" not in str(error):
            raise
        raise ValueError(f"checkpoint {load!r}: its tokenizer cannot be built ({error}). Evaluation needs the "
                         f"checkpoint's own tokenizer: keep the files its run recorded where they were, or pass "
                         f"--tokenizer-type and its files (--vocab-file/--merge-file, --tokenizer-model or "
                         f"--tokenizer-name-or-path)") from error


@register_model("megatron")
class MegatronLM(TemplateLM):
    """lm-eval's model interface over a GPTModel (see the module docstring for how each request is scored).

    ``device`` and ``max_batch_size`` are what the harness passes every model it builds from a string (the
    latter matters only for batch_size 'auto', refused here); ``checkpoint_kwargs`` go to the loading (tag,
    dtype, tokenizer overrides).
    """

    def __init__(self, model=None, tokenizer=None, config: Optional[ModelConfig] = None, *, load: Optional[str] = None,
                 batch_size: int | str = 1, max_length: Optional[int] = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, device=None, max_batch_size=None, **checkpoint_kwargs):
        super().__init__()
        if load is not None:  # `lm_eval --model megatron --model_args load=CKPT` once this module is imported
            generator = load_for_evaluation(load, **checkpoint_kwargs)
            model, tokenizer, config = generator.model.to(device or "cpu"), generator.tokenizer, generator.config
        if model is None or tokenizer is None or config is None:
            raise ValueError("MegatronLM needs a model, its tokenizer and its ModelConfig, or load=CKPT")
        if str(batch_size).startswith("auto"):
            raise ValueError(f"batch_size {batch_size!r}: MegatronLM takes a fixed batch size; pass a number")
        self.model = model  # in eval mode (a Generator's is)
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = config.original_vocab_size or config.padded_vocab_size
        self._batch_size = int(batch_size)
        self._max_length = int(max_length) if max_length else default_max_length(config)
        self._max_gen_toks = int(max_gen_toks)
        if self._batch_size < 1 or self._max_length < 2 or self._max_gen_toks < 1:
            raise ValueError(f"batch_size {self._batch_size} and max_gen_toks {self._max_gen_toks} must be >= 1, "
                             f"max_length {self._max_length} >= 2")
        self._device = next(model.parameters()).device

    @classmethod
    def from_checkpoint(cls, load: str, *, tag: Optional[str] = None, dtype: str = "fp32", parallel_state=None,
                        device=None, batch_size: int = 1, max_length: Optional[int] = None,
                        **tokenizer_overrides) -> "MegatronLM":
        """The checkpoint's model (on ``device``; with ``parallel_state``, this rank's tensor-parallel part)."""
        generator = load_for_evaluation(load, tag=tag, dtype=dtype, parallel_state=parallel_state,
                                        **tokenizer_overrides)
        if device is not None:
            generator.model.to(device)
        return cls(generator.model, generator.tokenizer, generator.config, batch_size=batch_size,
                   max_length=max_length)

    # -- what the harness asks of a model
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        # Our tokenizers add no special tokens, as the exported tokenizer.json (no post-processor) does not.
        return self.tokenizer.tokenize(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.detokenize(list(tokens))

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype),
                "tensor_parallel_size": getattr(self.model, "tp_size", 1)}

    # -- scoring
    @torch.inference_mode()
    def _log_probs(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """fp32 log-probabilities [b, s, v] of the next token at every position of ``rows`` (right-padded)."""
        width = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=self._device)  # [b, s]
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        logits = self.model(ids)  # [s, b, vp/tp]
        logits = gather_from_tensor_model_parallel_region(logits, self.model.tp_group)  # [s, b, vp]
        return F.log_softmax(logits[..., :self.vocab_size].float(), dim=-1).transpose(0, 1)  # [b, s, v]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              override_bs: Optional[int] = None) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is greedy) per (key, context ids, continuation ids)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        batch_size = override_bs or self._batch_size
        results: list[Optional[tuple[float, bool]]] = [None] * len(requests)
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            rows, continuations = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                if not context or not continuation or len(continuation) > self._max_length:
                    raise ValueError(f"request {i}: a context of {len(context)} and a continuation of "
                                     f"{len(continuation)} tokens; both must be non-empty, the continuation at "
                                     f"most max_length {self._max_length}")
                rows.append((list(context) + list(continuation))[-(self._max_length + 1):][:-1])
                continuations.append(list(continuation))
            log_probs = self._log_probs(rows)  # [b, s, v]
            for row, i, inputs, continuation in zip(range(len(chunk)), chunk, rows, continuations):
                scored = log_probs[row, len(inputs) - len(continuation):len(inputs)]  # [c, v]
                targets = torch.tensor(continuation, dtype=torch.long, device=scored.device)  # [c]
                greedy = bool((scored.argmax(dim=-1) == targets).all())
                results[i] = (float(scored.gather(1, targets[:, None]).sum()), greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood over the harness's rolling windows (each token predicted once)."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += log_prob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation
    def _sampling_params(self, gen_kwargs: dict) -> tuple[SamplingParams, int]:
        """The request's SamplingParams (stops: ``until`` and the end-of-document text) and its context limit."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self._max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]))
        max_new_tokens = kwargs.pop("max_gen_toks")
        temperature = kwargs.get("temperature")  # None: the default, 1 (do_sample alone samples, as HFLM)
        greedy = not kwargs.get("do_sample") or temperature == 0
        params = SamplingParams(max_new_tokens=max_new_tokens, greedy=greedy,
                                temperature=float(temperature) if temperature else 1.0,
                                top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                                seed=kwargs.get("seed"), stop=tuple(s for s in until if s)).validate()
        max_context = self._max_length - max_new_tokens
        if max_context < 1:
            raise ValueError(f"max_gen_toks {max_new_tokens} leaves no room for a context in max_length "
                             f"{self._max_length}; lower max_gen_toks or raise max_length")
        return params, max_context

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The generated text of every (context, gen_kwargs) request, cut before its first stop string."""
        sequences = []
        for index, (context, gen_kwargs) in enumerate(request.args for request in requests):
            params, max_context = self._sampling_params(gen_kwargs)
            ids = (self.tok_encode(context) or [self.prefix_token_id])[-max_context:]
            sequences.append(GeneratingSequence(ids, params, generator=sequence_generator(params, index),
                                                tokenizer=self.tokenizer, eod=self.eot_token_id, tag=index))
        texts: list[Optional[str]] = [None] * len(sequences)
        decoder = BatchDecoder(BatchRunner(self.model, self.vocab_size), max_batch_size=self._batch_size)
        pending = sorted(sequences, key=lambda s: -len(s.prompt_ids))
        while pending or decoder.rows:
            if pending and decoder.free_slots:
                joining, pending = pending[:decoder.free_slots], pending[decoder.free_slots:]
                finished = decoder.add(joining)
            else:
                finished = decoder.step()
            for sequence in finished:
                texts[sequence.tag] = sequence.completion("").text
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

"""lm-evaluation-harness tasks on the live model of a training run (--eval-harness-tasks, --eval-harness-interval).

    harness_eval = LiveHarness(engine, tokenizer, model_config, tasks=("tiny_choice",), include_path=...,
                               limit=None, micro_batch_size=2, tp_group=state.tp_group, make_batch=gpt_micro_batch,
                               model_engine=False)
    metrics = harness_eval()          # every rank calls it at the same iteration; {"task/metric": value}

On the pipeline engine (``PipelineEngineLM``) the model is read through ``engine.eval_batch`` (DeepSpeed's
inference schedule) on micro-batches laid out by the training loop's ``make_batch`` (tokens [b, s + 1] -> the
pipeline's tuple): every batch of requests is right-padded to the training shape [micro_batch_size, seq_length], so
the pipeline sends the activation shapes it always sends (with context parallelism each rank's ``make_batch`` keeps
its load-balanced tokens, as in training); the last stage gathers the logits over its TP group (and its CP group's
log-probabilities back into sequence order), takes the log-softmax over the tokenizer's rows (the padded vocabulary
is never scored) and broadcasts it over the pipeline group, so every rank runs the harness on the same numbers and
the same number of forwards. On the model engine (``ModelEngineLM``: ZeRO-2 / 3, hpZ, Ulysses; one stage) every
rank calls the engine's forward on its ``make_batch`` (Ulysses: its s / sp contiguous tokens; ZeRO-3 gathers each
module's parameters as in training, so every rank of a data-parallel group must run the same forwards, as it does
here) and gathers the log-probabilities over TP and the sequence group itself. Every data-parallel replica
evaluates every request (simple; the tasks are meant to be small).
Generation tasks (generate_until) are not run here (tools/evaluate.py runs them on a saved checkpoint).

What the training run must not notice: the harness seeds python's, numpy's and torch's generators, so
their states are saved before and restored after; the training data iterator is never touched
(``eval_batch`` reads its own); the module goes back to train mode. Nothing is saved in checkpoints, so a
resume is exactly what it would be without the evaluation.

Every rank gets the same metrics (``harness.score_tasks``: the harness's evaluation without the record of
the environment that simple_evaluate writes, and builds on LOCAL_RANK 0 only).

Shape letters: s sequence, b micro-batch, v vocabulary (unpadded), vp padded vocabulary.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.evaluation import harness
from megatron.evaluation.harness_model import MegatronLM
from megatron.parallel.context_parallel import gather_sequence
from megatron.parallel.mappings import gather_from_tensor_model_parallel_region, gather_replicated_sequence_region
from megatron.parallel.state import collective_device

__all__ = ["LiveHarness", "ModelEngineLM", "PipelineEngineLM"]


class PipelineEngineLM(MegatronLM):
    """MegatronLM scoring with a DeepSpeed pipeline engine's model (any TP / PP), on every rank alike."""

    def __init__(self, engine, tokenizer, config, *, tp_group, micro_batch_size: int, make_batch, cp_group=None):
        self.engine = engine
        self.tp_group, self.cp_group = tp_group, cp_group
        self._micro_batch_size = micro_batch_size
        self._make_batch = make_batch
        super().__init__(engine.module, tokenizer, config, batch_size=micro_batch_size, max_length=config.seq_length)

    @torch.no_grad()
    def _log_probs(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """fp32 log-probabilities [b, s, v] of the next token at every position of ``rows``, on every rank."""
        seq = self.config.seq_length
        tokens = torch.zeros(self._micro_batch_size, seq + 1, dtype=torch.long)  # [b, s + 1]
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        out = self._scored(tokens)  # [b, s, v]
        return out[:len(rows)].cpu()

    def _scored(self, tokens: torch.Tensor) -> torch.Tensor:
        """The log-probabilities [b, s, v] of the padded batch ``tokens`` [b, s + 1], on every rank."""
        _, logits = self.engine.eval_batch(iter([self._make_batch(tokens)]), return_logits=True, num_micro_batches=1)
        grid = self.engine.grid
        out = torch.empty(self._micro_batch_size, self.config.seq_length, self.vocab_size, dtype=torch.float32,
                          device=collective_device())  # [b, s, v]
        if self.engine.is_last_stage():
            out.copy_(gather_sequence(self._local_log_probs(logits), self.cp_group))  # CP: every rank's, in order
        if grid.pipe_parallel_size > 1:
            dist.broadcast(out, src=grid.stage_to_global(grid.pipe_parallel_size - 1),
                           group=grid.get_pipe_parallel_group())
        return out

    def _local_log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [s', b, vp/tp] (this rank's tokens, its vocabulary part) -> fp32 log-probabilities [b, s', v]
        over the tokenizer's rows."""
        logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)  # [s', b, vp]
        return F.log_softmax(logits[..., :self.vocab_size].float(), dim=-1).transpose(0, 1).contiguous()


class ModelEngineLM(PipelineEngineLM):
    """MegatronLM scoring with the model engine's model (``megatron.engine.model_engine``: ZeRO-2 / 3, hpZ, Ulysses,
    context parallelism on one stage), on every rank alike."""

    def __init__(self, engine, tokenizer, config, *, tp_group, micro_batch_size: int, make_batch, cp_group=None,
                 sp_group=None):
        super().__init__(engine, tokenizer, config, tp_group=tp_group, micro_batch_size=micro_batch_size,
                         make_batch=make_batch, cp_group=cp_group)
        self.sp_group = sp_group  # Ulysses: each rank's s / sp contiguous tokens

    def _scored(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, _ = self._make_batch(tokens)
        # Ulysses: the ranks' contiguous slices in rank order (CP's load-balanced ones: gather_sequence below)
        logits = gather_replicated_sequence_region(self.engine.logits(inputs), self.sp_group)  # [s/cp, b, vp/tp]
        return gather_sequence(self._local_log_probs(logits), self.cp_group)  # [b, s, v]


    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise ValueError("generation tasks (generate_until) are not run during training; drop them from "
                         "--eval-harness-tasks and run them with tools/evaluate.py on a saved checkpoint")


class LiveHarness:
    """The run's harness tasks, scored on the live model when called (on every rank at once)."""

    def __init__(self, engine, tokenizer, config, *, tasks: Sequence[str], include_path: Optional[str],
                 limit: Optional[float], micro_batch_size: int, tp_group, make_batch, seed: int = 1234,
                 cp_group=None, sp_group=None, model_engine: bool = False):
        self.tasks = list(tasks)
        self.manager = harness.task_manager(self.tasks, include_path)
        self.settings = harness.HarnessSettings(limit=limit, seed=seed)
        common = dict(tp_group=tp_group, micro_batch_size=micro_batch_size, make_batch=make_batch, cp_group=cp_group)
        self.lm = (ModelEngineLM(engine, tokenizer, config, sp_group=sp_group, **common) if model_engine
                   else PipelineEngineLM(engine, tokenizer, config, **common))

    def __call__(self) -> dict[str, float]:
        states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                  torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        try:
            results = harness.score_tasks(self.lm, self.tasks, self.manager, self.settings)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
            if states[3] is not None:
                torch.cuda.set_rng_state_all(states[3])
            self.lm.engine.train()
        return harness.headline_metrics(results)

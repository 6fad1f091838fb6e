"""Activation recomputation: none vs --recompute-granularity selective vs full, time and memory of one step.

Our GPTModel (megatron.model) alone, one process, BLOOM-style (ALiBi, embedding LayerNorm), SDPA attention,
4 layers, hidden 256, 8 heads, seq 1024, micro-batch 2, fp32 by default, no dropout; the same weights and
batch in every mode:

    none       every activation kept for backward
    selective  the attention core softmax(QK^T)V recomputed from the kept q, k, v (recompute_core_attention)
    full       only each layer's input kept, the whole layer recomputed (GPTModel.recompute_activations,
               one layer per chunk: --checkpoint-activations --checkpoint-num-layers 1)

Per mode: the median forward + backward seconds over --reps alternated repetitions (rotating order), the
bytes the forward keeps for backward (saved-tensor hooks around the forward: for full, what the checkpoint
keeps), the peak RSS growth of the first forward + backward in a fresh process (VmHWM reset through
/proc/self/clear_refs once the model is built), and that
the loss and gradients equal mode none's. Prints ONE JSON line.

    python -m benchmarks.bench_recompute --output benchmarks/results/recompute_<date>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time

import torch

from benchmarks import _common  # first: sets DS_ACCELERATOR before deepspeed is imported
from benchmarks._common import emit, machine
from benchmarks.bench_attention import cpu_flags, cpu_peak_rss_growth
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, tracked_checkpoint_func
from megatron.parallel.state import ParallelState

MODES = ("none", "selective", "full")


def build(mode: str, args) -> GPTModel:
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 99)
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         seq_length=args.seq, max_position_embeddings=args.seq, padded_vocab_size=args.vocab,
                         position_embedding_type="alibi", embed_layernorm=True, hidden_dropout=0.0,
                         attention_dropout=0.0, params_dtype=args.dtype, attention_backend="sdpa", seed=1234)
    config = dataclasses.replace(config, recompute_core_attention=mode == "selective")
    model = GPTModel(config, ParallelState.single(), rng_tracker=tracker).train()
    if mode == "full":
        model.recompute_activations(tracked_checkpoint_func(tracker), num_layers=1)
    return model


def step(model: GPTModel, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], labels=ids[:, 1:], loss_mask=torch.ones(ids.shape[0], ids.shape[1] - 1))
    loss.backward()
    return loss.item()


def saved_bytes(model: GPTModel, ids: torch.Tensor) -> int:
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = model(ids[:, :-1], labels=ids[:, 1:], loss_mask=torch.ones(ids.shape[0], ids.shape[1] - 1))
    del loss
    return sum(sizes)


def peak_in_fresh_process(mode: str, args) -> int:
    """Peak RSS growth of the first forward + backward of ``mode`` in a new process (a process that has
    already run a step keeps its heap, so later peaks hide in memory it already holds)."""
    argv = [sys.executable, "-m", "benchmarks.bench_recompute", "--peak-child", mode] + [
        f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "dtype",
                                              "threads")]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True, cwd=_common.REPO).stdout
    return int(out.strip().splitlines()[-1])


def peak_child(mode: str, args) -> None:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    model = build(mode, args)
    print(cpu_peak_rss_growth(lambda: step(model, ids)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peak-child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak_child:
        return peak_child(args.peak_child, args)
    before = machine()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    models = {mode: build(mode, args) for mode in MODES}
    reference = models["none"].state_dict()
    for model in models.values():  # same weights everywhere (they are built from the same seed anyway)
        model.load_state_dict(reference)

    losses, grads = {}, {}
    for mode, model in models.items():
        losses[mode] = step(model, ids)
        grads[mode] = {n: q.grad.clone() for n, q in model.named_parameters()}
    equal = {mode: {"loss_equal": losses[mode] == losses["none"],
                    "max_abs_grad_diff": max((grads[mode][n] - grads["none"][n]).abs().max().item()
                                             for n in grads["none"])} for mode in MODES}
    times = {mode: [] for mode in MODES}
    for rep in range(args.reps):
        order = MODES[rep % 3:] + MODES[:rep % 3]
        for mode in order:
            start = time.perf_counter()
            step(models[mode], ids)
            times[mode].append(time.perf_counter() - start)
    results = {}
    for mode, model in models.items():
        results[mode] = {"fwd_bwd_s": statistics.median(times[mode]), "fwd_bwd_s_all_reps": times[mode],
                         "saved_for_backward_mib": saved_bytes(model, ids) / 2 ** 20,
                         "peak_rss_above_start_mib": peak_in_fresh_process(mode, args) / 2 ** 20, **equal[mode]}
    ratios = {f"{mode}_over_none": {"time": results[mode]["fwd_bwd_s"] / results["none"]["fwd_bwd_s"],
                                    "saved_for_backward": results[mode]["saved_for_backward_mib"] /
                                    results["none"]["saved_for_backward_mib"]} for mode in ("selective", "full")}
    emit({"benchmark": "recompute", "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
          "config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "dtype",
                                                    "reps")} | {"position": "alibi", "attention_backend": "sdpa"},
          "results": results, "ratios": ratios, "machine": before}, args.output)


if __name__ == "__main__":
    main()

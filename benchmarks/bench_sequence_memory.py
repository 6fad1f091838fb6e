"""Activation memory per rank of one transformer layer with sequence parallelism and Ulysses, measured vs the planner.

One GPT-style layer (learned positions, LayerNorm, GeLU MLP, hidden 256, 8 heads, s = 512, micro-batch 2, fp32,
hidden dropout 0.1, no attention dropout, SDPA with is_causal: no [np, s, s] scores kept) inside a 2-layer
GPTModel, on the layouts (TP, Ulysses SP, --sequence-parallel) below, gloo on CPU, one launch per world size.
Measured: the bytes of every distinct storage autograd keeps for backward while layer 0 runs its forward
(saved-tensor hooks; parameters, and views of one storage counted once, are left out), on every rank.
Predicted: ``megatron.planner.memory.layer_activation_bytes`` (Korthikanti et al. 2022's per-layer terms as the
planner counts them, fp32: 4 bytes per element, SDPA's fused kernel: no scores, the SP layers keeping their
all-gathered inputs). Reported per layout: measured / predicted, and each layout's measured bytes relative to
TP's own layout without the sequence axes (what SP and Ulysses save). The planner counts 1-byte dropout masks
(CUDA's fused dropout); on the CPU F.dropout keeps an fp32 mask, so the prediction is also given with that
difference added. Prints ONE JSON line.

    python -m benchmarks.bench_sequence_memory --output benchmarks/results/sequence_memory_<date>.json
"""

from __future__ import annotations

import argparse

from benchmarks import _common  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import emit, machine

# (tp, ulysses, --sequence-parallel)
LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (4, 1, False), (4, 1, True), (1, 2, False), (1, 4, False),
           (2, 2, False), (2, 2, True)]
MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=512, micro_batch=2)


def _config(sequence_parallel: bool):
    from megatron.config import ModelConfig

    return ModelConfig(num_layers=MODEL["num_layers"], hidden_size=MODEL["hidden_size"],
                       num_attention_heads=MODEL["num_attention_heads"], seq_length=MODEL["seq_length"],
                       padded_vocab_size=512, position_embedding_type="absolute", hidden_dropout=0.1,
                       attention_dropout=0.0, attention_backend="sdpa", params_dtype="fp32",
                       sequence_parallel=sequence_parallel)


def _measure(rank, world_size, layouts):
    import torch

    from megatron.engine.initialize import init_deepspeed_comm
    from megatron.engine.ulysses import ulysses_exchange
    from megatron.model import GPTModel
    from megatron.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker
    from megatron.parallel.state import ParallelState

    torch.set_num_threads(1)
    init_deepspeed_comm("gloo")
    out = []
    for tp, u, sp in layouts:
        state = ParallelState.create(tp=tp, pp=1, sp=u)
        try:
            tracker = RNGStatesTracker("cpu")
            tracker.add(MODEL_PARALLEL_RNG, 1000 + state.tp_rank)
            torch.manual_seed(0)
            model = GPTModel(_config(sp and tp > 1), state, rng_tracker=tracker,
                             sequence_exchange=ulysses_exchange(state)).train()
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            seen, active = {}, [False]

            def pack(t):
                if active[0]:
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in params:
                        seen[storage.data_ptr()] = storage.nbytes()
                return t

            layer = model.layers[0]
            layer.register_forward_pre_hook(lambda *_: active.__setitem__(0, True))
            layer.register_forward_hook(lambda *_: active.__setitem__(0, False))
            s = MODEL["seq_length"] // u
            ids = torch.randint(0, 500, (MODEL["micro_batch"], s), generator=torch.Generator().manual_seed(1))
            positions = torch.arange(s)[None] + state.sp_rank * s
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(ids, positions, labels=ids).sum()
            loss.backward()
            out.append({"tp": tp, "ulysses": u, "sequence_parallel": sp, "rank": rank,
                        "measured_bytes": sum(seen.values())})
        finally:
            state.destroy()
    return out


def predicted_bytes(tp: int, u: int, sp: bool) -> float:
    from megatron.planner.candidate import Layout
    from megatron.planner.memory import layer_activation_bytes
    from megatron.planner.specs import model_shape_of

    layout = Layout(tp, 1, 1, MODEL["micro_batch"], sequence_parallel=sp and tp > 1, ulysses=u,
                    store_attention_scores=False)
    return layer_activation_bytes(model_shape_of(_config(sp and tp > 1)), layout, MODEL["seq_length"], 4,
                                  sp_saves_gathered_inputs=True)


def cpu_dropout_mask_extra_bytes(tp: int, u: int, sp: bool) -> float:
    """F.dropout on a CPU tensor that requires grad keeps its mask in the activation's dtype (x * mask, 4 bytes
    per element in fp32; measured), not the 1-byte mask of CUDA's fused dropout the planner counts: 3 bytes
    more per element for each of the layer's two hidden dropouts, on s/u tokens (/ tp with SP)."""
    elements = MODEL["seq_length"] / u * MODEL["micro_batch"] * MODEL["hidden_size"] / (tp if sp and tp > 1 else 1)
    return 2 * (4 - 1) * elements


def main() -> None:
    from megatron.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    args = p.parse_args()
    before = machine()
    by_world: dict[int, list] = {}
    for layout in LAYOUTS:
        by_world.setdefault(layout[0] * layout[1], []).append(layout)
    rows = []
    for world, layouts in sorted(by_world.items()):
        per_rank = run_distributed(_measure, world_size=world, args=(layouts,), timeout=900)
        for i, (tp, u, sp) in enumerate(layouts):
            measured = [ranks[i]["measured_bytes"] for ranks in per_rank]
            predicted = predicted_bytes(tp, u, sp)
            masks = cpu_dropout_mask_extra_bytes(tp, u, sp)
            rows.append({"tp": tp, "ulysses": u, "sequence_parallel": sp, "measured_bytes_per_rank": measured,
                         "predicted_bytes": predicted, "measured_over_predicted": max(measured) / predicted,
                         "predicted_with_cpu_dropout_masks": predicted + masks,
                         "measured_over_predicted_with_cpu_dropout_masks": max(measured) / (predicted + masks)})
    base = {r["tp"]: max(r["measured_bytes_per_rank"]) for r in rows if r["ulysses"] == 1 and not r["sequence_parallel"]}
    for r in rows:
        r["measured_over_same_tp_without_sequence_axes"] = max(r["measured_bytes_per_rank"]) / base[r["tp"]]
    emit({"benchmark": "sequence_memory", "config": dict(MODEL, dtype="fp32", hidden_dropout=0.1, attention="sdpa causal",
                                                         positions="learned"),
          "compared_with": "megatron.planner.memory.layer_activation_bytes (fp32, no scores, SP keeps gathered inputs); "
                           "also with the CPU's dtype-wide dropout masks added (cpu_dropout_mask_extra_bytes)",
          "rows": rows, "machine": before}, args.output)


if __name__ == "__main__":
    main()

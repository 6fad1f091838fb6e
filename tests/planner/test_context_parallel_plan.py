"""The planner's context parallelism (ring attention) against what a CP = 2 run holds and sends.

One 2-process launch (gloo, fp32) does two things on each rank:
- activations: one layer of a 2-layer BLOOM-style GPTModel at CP = 2 (s = 64, 32 tokens per rank, micro-batch 2,
  hidden dropout 0.1), the bytes of every distinct storage autograd keeps for backward while layer 0 runs its
  forward (saved-tensor hooks, parameters left out; ``benchmarks/bench_sequence_memory.py``'s method), against
  ``layer_activation_bytes`` at CP = 2, plus the CPU's dtype-wide dropout masks (the planner counts CUDA's 1-byte
  ones): within 5%;
- p2p bytes: a tiny CP = 2 training run (pretrain_gpt's path, ZeRO-1, 3 iterations, once without and once with
  --checkpoint-activations), counting every byte this rank hands ``batch_isend_irecv`` in
  ``megatron.parallel.context_parallel`` (the ring), against ``step_ring_bytes`` x iterations: equal.
"""

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import tolerance

# The planner's formulas and the ones written out here are both Python float64 arithmetic of a dozen or so
# operations, in other orders: within 16 roundings in sequence of float64, nothing summed wider
# (megatron.testing.tolerance), relative. Python's float arithmetic is the same on every CPU.
F64 = tolerance(torch.float64, 16, 1)

SEQ, MICRO_BATCH, HIDDEN, HEADS, ITERS = 64, 2, 64, 4, 3


def _config():
    from megatron.config import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                       padded_vocab_size=128, position_embedding_type="alibi", hidden_dropout=0.1,
                       attention_dropout=0.0, params_dtype="fp32")


def _layer_saved_bytes(state) -> int:
    """Bytes of the distinct storages layer 0 saves for backward on this rank (its load-balanced tokens)."""
    import torch

    from megatron.model import GPTModel
    from megatron.parallel.context_parallel import load_balanced_positions
    from megatron.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker

    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 1000)
    torch.manual_seed(0)
    model = GPTModel(_config(), state, rng_tracker=tracker).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, active = {}, [False]

    def pack(t):
        if active[0] and t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    layer = model.layers[0]
    layer.register_forward_pre_hook(lambda *_: active.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: active.__setitem__(0, False))
    positions = load_balanced_positions(SEQ, 2, state.cp_rank)[None].expand(MICRO_BATCH, -1)  # [b, s/c]
    ids = torch.randint(0, 120, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids = torch.gather(ids, 1, positions)  # this rank's tokens of the whole sequence
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, positions, labels=ids).sum()
    loss.backward()
    return sum(seen.values())


def _worker(rank, world_size, runs):
    import torch

    import megatron.parallel.context_parallel as context_parallel
    from megatron.arguments import run_config_from_argv
    from megatron.parallel.state import ParallelState
    from megatron.training.pretrain import pretrain

    torch.set_num_threads(1)
    state = ParallelState.create(tp=1, pp=1, cp=2)
    try:
        activations = _layer_saved_bytes(state)
    finally:
        state.destroy()
    sent, original = [], context_parallel.dist.batch_isend_irecv

    def counting(ops):  # every byte this rank sends through the ring
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops
                    if op.op is context_parallel.dist.isend)
        return original(ops)

    context_parallel.dist.batch_isend_irecv = counting
    ring = []
    try:
        for argv in runs:
            sent.clear()
            result = pretrain(run_config_from_argv(argv, world_size=world_size))
            ring.append({"bytes": sum(sent), "sends": len(sent), "iterations": len(result.history)})
    finally:
        context_parallel.dist.batch_isend_irecv = original
    return {"activation_bytes": activations, "ring": ring}


@pytest.fixture(scope="module")
def measured(tiny_corpus):
    base = tiny_argv(tiny_corpus, "--context-parallel-size", "2", train_iters=ITERS, zero_stage=1,
                     seq_length=SEQ, max_position_embeddings=SEQ)
    runs = [base, base + ["--checkpoint-activations"]]
    return runs, run_distributed(_worker, world_size=2, args=(runs,), timeout=300)


@pytest.mark.multiprocess
def test_activation_bytes_per_rank_match_the_planner_within_5_percent(measured):
    from megatron.planner.candidate import Layout
    from megatron.planner.memory import layer_activation_bytes
    from megatron.planner.specs import model_shape_of

    layout = Layout(1, 1, 1, MICRO_BATCH, cp=2)
    predicted = layer_activation_bytes(model_shape_of(_config()), layout, SEQ, 4)
    # F.dropout on the CPU keeps a 4-byte mask where the planner counts CUDA's 1-byte one: two hidden dropouts
    cpu_masks = 2 * (4 - 1) * SEQ // 2 * MICRO_BATCH * HIDDEN
    for rank, result in enumerate(measured[1]):
        ratio = result["activation_bytes"] / (predicted + cpu_masks)
        assert abs(ratio - 1) <= 0.05, f"rank {rank}: measured {result['activation_bytes']} B, planner " \
                                       f"{predicted + cpu_masks:.0f} B ({ratio:.4f})"


@pytest.mark.multiprocess
def test_ring_p2p_bytes_per_step_equal_the_planner_count(measured):
    from megatron.arguments import run_config_from_argv
    from megatron.planner.candidate import Layout
    from megatron.planner.context_parallel import step_ring_bytes
    from megatron.planner.specs import model_shape_of

    runs, results = measured
    for i, argv in enumerate(runs):
        rc = run_config_from_argv(argv, world_size=2)
        layout = Layout(1, 1, 1, rc.batch.micro_batch_size, recompute=rc.training.checkpoint_activations, cp=2)
        step = step_ring_bytes(model_shape_of(rc.model, 512), layout, rc.data.seq_length, 4, rc.model.num_layers,
                               rc.batch.num_micro_batches(1))
        for rank, result in enumerate(results):
            ring = result["ring"][i]
            assert ring["iterations"] == ITERS, (rank, ring)
            assert (ring["bytes"], ring["sends"]) == (ITERS * step["total"], ITERS * step["sends"]), \
                f"rank {rank} run {i}: measured {ring}, planner per step {step}"


def test_cp_layer_activations_ring_bytes_and_overlap_by_hand():
    import dataclasses

    from megatron.planner import CLUSTERS, GPUS, ModelShape
    from megatron.planner.candidate import Layout
    from megatron.planner.context_parallel import ring_buffer_bytes, ring_bytes, ring_exposed_s
    from megatron.planner.memory import estimate_memory, layer_activation_bytes

    tiny, s = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256), 32
    cp2 = Layout(1, 1, 1, 2, recompute=False, cp=2)
    assert (cp2.world_size, cp2.weight_replicas, cp2.sequence_split, cp2.sequence_label) == (2, 2, 2, "CP2")
    # 16 tokens x b 2 x h 64: Korthikanti's 34 without scores, + the kernel's second context (2 bytes per h) and
    # its fp32 log-sum-exp (4 bytes per head)
    assert layer_activation_bytes(tiny, cp2, s) == 2048 * 34 + 32 * (2 * 64 + 4 * 4)
    # one K block = b 2 x 64 x 16 tokens = 2048 elements: forward K + V once, backward again + 2 x fp32 dK + dV
    assert ring_bytes(tiny, cp2, s, 2) == {"forward": 8192, "backward": 8192 + 32768, "recomputed_forward": 0,
                                           "total": 49152, "sends": 8}
    assert ring_bytes(tiny, dataclasses.replace(cp2, recompute=True), s, 2)["total"] == 49152 + 8192
    assert ring_buffer_bytes(tiny, cp2, s, 2) == 4 * 2048 * (2 + 4)
    one, two = (estimate_memory(tiny, lay, s, 2).per_stage[0] for lay in (Layout(1, 1, 1, 2, recompute=False), cp2))
    assert two["adam"] == one["adam"] / 2  # ZeRO-1 over dp x cp
    assert two["activations"] < 0.6 * one["activations"]
    gpu, cluster = GPUS["A100-80GB"], dataclasses.replace(CLUSTERS["dgx-a100"], p2p_latency_us=0.0)
    bw = gpu.nvlink_busbw_gbps * 1e9
    # compute far slower than the link: every K / V hop hidden, only the c dK / dV hops exposed
    assert ring_exposed_s(tiny, cp2, gpu, cluster, s, 2, 1.0) == pytest.approx(2 * 2 * 2 * 2048 * 4 / bw, rel=F64, abs=0)
    # compute instant: nothing hidden
    assert ring_exposed_s(tiny, cp2, gpu, cluster, s, 2, 1e30) == pytest.approx(2 * 49152 / bw, rel=F64, abs=0)


def test_bloom_176b_layout_at_32k_fits_with_cp8_at_micro_batch_2_and_cp4_at_1():
    """docs/parallelism.md's figures: BLOOM-176B's TP=4 PP=12 on 384 A100-80GB (DP x CP = 8, ZeRO-1, recompute,
    global batch 2048) at 32k tokens: stage 0 holds 12 micro-batches' checkpointed inputs of 5 layers."""
    from megatron.planner import BLOOM_SIZES, GPUS
    from megatron.planner.candidate import Layout
    from megatron.planner.memory import MEMORY_HEADROOM, estimate_memory
    from megatron.planner.search import longest_sequence_of_layout
    from megatron.planner.specs import GiB

    model, gpu, limit = BLOOM_SIZES["176B"], GPUS["A100-80GB"], GPUS["A100-80GB"].memory_bytes * MEMORY_HEADROOM

    def bloom(cp, micro_batch, **kw):
        return Layout(4, 12, 8 // cp, micro_batch, recompute=True, zero_stage=1, cp=cp,
                      partition_method="type:transformer|embedding", **kw)

    peaks = {(c, b): estimate_memory(model, bloom(c, b), 32768, 2048).peak / GiB for c in (2, 4, 8) for b in (1, 2)}
    assert [peaks[(c, 2)] <= limit / GiB for c in (2, 4, 8)] == [False, False, True], peaks
    assert [peaks[(c, 1)] <= limit / GiB for c in (2, 4, 8)] == [False, True, True], peaks
    # the figures as docs/parallelism.md prints them, to two decimals: within half a unit of the last place
    assert peaks[(8, 2)] == pytest.approx(56.94, abs=0.005) and peaks[(4, 2)] == pytest.approx(75.65, abs=0.005)
    # CP = 1 with a fused kernel (no [np, s, s] scores, as ring attention keeps none) and with the scores kept
    longest = [longest_sequence_of_layout(model, bloom(c, 2, store_attention_scores=False), gpu, 2048)
               for c in (1, 2, 4, 8)]
    assert longest == [7680, 14592, 29440, 59136]
    assert longest_sequence_of_layout(model, bloom(1, 2), gpu, 2048) == 4864


def test_on_one_node_cp_fits_less_than_tp_with_sp():
    """docs/parallelism.md: BLOOM-7B1 on 8 GPUs, recomputation, micro-batch 1, fused attention: a CP rank holds the
    whole layer's weights, which TP splits."""
    from megatron.planner import BLOOM_SIZES, GPUS
    from megatron.planner.candidate import Layout
    from megatron.planner.search import longest_sequence_of_layout

    longest = [longest_sequence_of_layout(BLOOM_SIZES["7B1"], Layout(tp, 1, 1, 1, zero_stage=1 if cp > 1 else 0,
                                                                     sequence_parallel=tp > 1, cp=cp,
                                                                     store_attention_scores=False),
                                          GPUS["A100-80GB"], 8) for tp, cp in ((8, 1), (4, 2), (2, 4), (1, 8))]
    assert longest == [148480, 125184, 89344, 17408]

"""The rules context parallelism (``--context-parallel-size``, ring attention) adds across a ``RunConfig``: the
sequence must split into 2 x cp chunks, and what does not work with it yet is refused by name before launch."""

from __future__ import annotations


def check_context_parallel_run(rc) -> None:
    """ValueError naming the values and the fix for a context-parallel run that cannot work (yet)."""
    cp = rc.parallel.context_parallel_size
    if cp == 1:
        return
    flag, m = f"--context-parallel-size {cp}", rc.model
    if m.seq_length % (2 * cp):
        raise ValueError(f"--seq-length {m.seq_length} is not divisible by 2 x {flag} = {2 * cp}: each rank holds two "
                         f"equal chunks of every sample (chunks i and {2 * cp - 1}-i, for even causal work); use a "
                         f"multiple of {2 * cp}")
    tp = rc.parallel.tensor_model_parallel_size
    if m.sequence_parallel and (m.seq_length // cp) % tp:
        raise ValueError(f"--seq-length {m.seq_length} / {flag} = {m.seq_length // cp} tokens per rank do not split "
                         f"over --tensor-model-parallel-size {tp} for --sequence-parallel; use a --seq-length that is "
                         f"a multiple of {cp * tp * 2}")
    unsupported = [
        (rc.parallel.ds_sequence_parallel_size > 1,
         f"--ds-sequence-parallel-size {rc.parallel.ds_sequence_parallel_size} (both split the sequence)"),
        (rc.parallel.zero_hpz_partition_size > 1, f"--zero-hpz-partition-size {rc.parallel.zero_hpz_partition_size}"),
        (m.moe is not None, "MoE (--num-experts)"),
        (m.attention_dropout > 0, f"--attention-dropout {m.attention_dropout} (the ring kernel has no dropout; use 0)"),
        (m.attention_backend not in ("auto", "sdpa"),
         f"--attention-backend {m.attention_backend} (ring attention is its own kernel; use auto)"),
        (m.recompute_core_attention, "selective recomputation of the core attention"),
        (rc.training.torch_compile, "--torch-compile"),
        (bool(rc.training.eval_harness_tasks), "--eval-harness-tasks (evaluate saved checkpoints instead)"),
        (rc.checkpoint.universal_checkpoint, "--universal-checkpoint"),
    ]
    named = [name for given, name in unsupported if given]
    if named:
        raise ValueError(f"{flag} does not work yet with {'; '.join(named)}: refused rather than run wrongly; drop "
                         f"{'it' if len(named) == 1 else 'them'}, or train with --context-parallel-size 1")

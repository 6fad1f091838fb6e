"""The rules context parallelism (``--context-parallel-size``, ring attention) adds across a ``RunConfig``: the
sequence must split into 2 x cp chunks, and what does not work with it yet is refused by name before launch (the
table in ``megatron.config.combinations``)."""

from __future__ import annotations

from megatron.config.combinations import check_combinations


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
    check_combinations(rc, "context parallelism")

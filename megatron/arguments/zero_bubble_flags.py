"""The zero-bubble pipeline flags (one argument group), Megatron-DeepSpeed's names; the rules a run must meet
are ``megatron.config.zero_bubble.check_zero_bubble_run``."""

from __future__ import annotations

__all__ = ["add_zero_bubble_arguments"]


def add_zero_bubble_arguments(parser) -> None:
    g = parser.add_argument_group("zero-bubble pipeline (ZB-H1)")
    g.add_argument("--enable-zbh1-pipeline", action="store_true",
                   help="ZB-H1 pipeline schedule (Qi et al. 2023): each backward pass computes the input gradients "
                        "only, and the weight gradients of the linear layers and the output head run later, in the "
                        "cool-down slots 1F1B leaves idle; 1F1B's activation memory. Needs "
                        "--enable-zbh1-exact-semantics, the pipeline engine (--zero-stage 0 or 1; 0 in fp32) and at "
                        "least as many micro-batches per step as pipeline stages (docs/parallelism.md).")
    g.add_argument("--enable-zbh1-exact-semantics", action="store_true",
                   help="With --enable-zbh1-pipeline: the gradient clipping and the optimizer step come after every "
                        "deferred weight gradient, so each step equals 1F1B's (the only mode run here).")

"""The hang and straggler flags (one argument group): Megatron-LM's ``--log-straggler`` and
``--straggler-minmax-count`` (the report: ``megatron.training.straggler``), and our ``--hang-watchdog-*``
(Megatron-LM has no flag for a per-rank step watchdog; the watchdog: ``megatron.training.watchdog``).
"""

from __future__ import annotations

__all__ = ["add_resilience_arguments"]


def add_resilience_arguments(parser) -> None:
    g = parser.add_argument_group("hang and straggler detection")
    g.add_argument("--log-straggler", action="store_true",
                   help="Megatron-LM's flag: every --log-interval, each rank's forward compute time per iteration "
                        "(the model's forward calls, as Megatron-LM's straggler detector times them) is gathered, "
                        "and the fastest and slowest ranks are named with their times on the log line and to "
                        "TensorBoard / W&B (straggler/...). Under tensor or pipeline parallelism the forward "
                        "includes their communication and a stage's own work. Default: off.")
    g.add_argument("--straggler-minmax-count", type=int, default=1,
                   help="Megatron-LM's flag: how many of the fastest and of the slowest ranks --log-straggler "
                        "names. Default: 1.")
    g.add_argument("--hang-watchdog-factor", type=float, default=None,
                   help="Turn on the hang watchdog (our flag: Megatron-LM has none for this; its nearest are the "
                        "in-process restart's --inprocess-soft-timeout and the fault-tolerance package): a thread on "
                        "each rank that, when a training step has run longer than this many times the median of "
                        "the recent steps (and --hang-watchdog-min-seconds), writes every thread's Python stack of "
                        "each rank that still runs to the log, names the ranks that no longer answer, and ends the "
                        "job with exit status 1, before --distributed-timeout-minutes would end it without stacks. "
                        "Only training steps are watched: evaluations and saves between them are not. Default: off.")
    g.add_argument("--hang-watchdog-min-seconds", type=float, default=60.0,
                   help="The hang watchdog fires only on a step that has run at least this long (a floor under "
                        "--hang-watchdog-factor x the median); must be below --distributed-timeout-minutes. "
                        "Default: 60.")
    g.add_argument("--hang-watchdog-warmup-iters", type=int, default=5,
                   help="The first this many training steps of each launch (compilation, warm-up, the first steps "
                        "after a resume) are neither watched nor counted in the median. Default: 5.")

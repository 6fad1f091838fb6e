"""Benchmark scripts, each printing one JSON line (dated results in ``results/``). Run one from the checkout's
root as a module, ``python -m benchmarks.bench_<name>``: the checkout's ``megatron`` is then the one imported."""

"""Megatron-style model core on a DeepSpeed 3D engine.

Packages, in the one direction imports may run:
    training -> engine -> model -> parallel -> torch;  data is used by training.
Only ``megatron.engine`` imports deepspeed. ``megatron.model`` and ``megatron.parallel``
read no global arguments and no environment variables.

The packages and modules (each states more in its own docstring):

    arguments      the command line -> the run configuration (a frozen, validated ``RunConfig``)
    benchmarking   harnesses that run training steps on a live DeepSpeed engine, measured against the planner
    checkpoint     saving and resuming a run, merging any TP / PP, universal checkpoints, transformers conversion
    cli            shared by the command-line tools: how a tool's ``main`` ends; the model flags of generate and serve
    config         configuration dataclasses: what the model, the parallel layout and the run need, validated
    data           tokenizers, Megatron's mmap indexed dataset, GPT samples, blending and samplers
    dry_run        ``pretrain_gpt.py --dry-run``: a job checked and planned without starting it
    engine         the DeepSpeed side: the engine, its pipeline schedules, ZeRO-2 / 3, Ulysses, expert parallelism
    evaluation     EleutherAI's lm-evaluation-harness on checkpoints of any TP / PP
    inference      using trained checkpoints: text generation and an HTTP server
    model          GPT / BLOOM / Llama-style model math, tensor-parallel, sequence-first [s, b, h]
    parallel       tensor parallelism written here (process groups, collectives, layers), plain torch
    planner        planning and accounting for parallel layouts: what fits, how fast it should run, what it sends
    testing        utilities for tests and benchmarks: runs on several CPU processes, a tiny corpus and model
    training       the training loop around the engine: set-up, train step, evaluation, logging, exits
"""

__version__ = "0.1.0"

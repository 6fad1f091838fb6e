"""Harnesses that run the real thing: training steps on a live DeepSpeed engine, measured against the models.

    measure   bytes per rank (weights, gradients, optimizer state) and the collectives of a training step,
              read off a live engine (either DeepSpeed engine), beside what ``megatron.planner`` predicts

At the level of an entry point: imports the training loop, the engine, the arguments and the planner;
benchmarks/ and tests/ use it, nothing in ``megatron`` below it does.
"""

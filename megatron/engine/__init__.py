"""The DeepSpeed side: the engine (with ``megatron.checkpoint.universal``'s key names, the only deepspeed imports).

- ``cpu``: accelerator quirks (DeepSpeed's JIT C++ builds avoided on CPU so a fresh machine starts fast);
- ``pipeline``: the model's own modules staged as a DeepSpeed ``PipelineModule`` (tied embedding,
  partition methods, activation checkpointing);
- ``optimizer``: parameter groups (no weight decay on biases and norms) and the fp32 grad-norm clipper;
- ``initialize``: ``build_engine(run_config, state)``: ``deepspeed.initialize`` on our topology, with the
  DeepSpeed config ``megatron.config.deepspeed`` derives from the run.

Imports ``megatron.model`` and ``megatron.parallel``; nothing below it imports this package.
"""

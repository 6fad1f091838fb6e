"""The DeepSpeed side: the engine (with ``megatron.checkpoint.universal``'s key names, the only deepspeed imports).

- ``deepspeed_compat``: every workaround for how the pinned DeepSpeed behaves, each checked against the
  installed version (private DeepSpeed state, its loaders' quirks, safe unpickling, JIT builds avoided on CPU);
- ``cpu``: the accelerator in use and the C++ compiler --torch-compile needs;
- ``pipeline``: the model's own modules staged as a DeepSpeed ``PipelineModule`` (tied embedding,
  partition methods, activation checkpointing);
- ``optimizer``: parameter groups (no weight decay on biases and norms) and the fp32 grad-norm clipper;
- ``initialize``: ``build_engine(run_config, state)``: ``deepspeed.initialize`` on our topology, with the
  DeepSpeed config ``megatron.config.deepspeed`` derives from the run.

Imports ``megatron.model`` and ``megatron.parallel``; nothing below it imports this package.
"""

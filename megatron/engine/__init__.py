"""The DeepSpeed side: the engine (with ``megatron.checkpoint.universal``'s key names, the only deepspeed imports).

- ``deepspeed_compat``: every workaround for how the pinned DeepSpeed behaves, each checked against the
  installed version (private DeepSpeed state, its loaders' quirks, safe unpickling, JIT builds avoided on CPU);
- ``cpu``: the accelerator in use and the C++ compiler --torch-compile needs;
- ``pipeline``: the model's own modules staged as a DeepSpeed ``PipelineModule`` (tied embedding,
  partition methods, activation checkpointing);
- ``optimizer``: parameter groups (no weight decay on biases and norms) and the fp32 grad-norm clipper;
- ``adam_state_dtypes``: AdamW with its moments stored in bf16 / fp16 (Megatron-LM's precision-aware optimizer);
- ``muon``: ``--optimizer muon``: Newton-Schulz-orthogonalised momentum for the matrices (whole over TP, or per
  shard), AdamW for the rest; on ZeRO-1 / 2 and BF16_Optimizer's flat partitions too;
- ``initialize``: ``build_engine(run_config, state)``: ``deepspeed.initialize`` on our topology, with the
  DeepSpeed config ``megatron.config.deepspeed`` derives from the run;
- ``model_engine``: the model engine: ZeRO-2 / ZeRO-3 data parallelism and Ulysses with our tensor parallelism, a
  whole ``GPTModel`` on DeepSpeed's ``DeepSpeedEngine`` (``ModelEngine``; "model" in run_state.json and
  ``ds_to_universal.py --target-engine``); the other engine is the pipeline engine (``pipeline``, ``schedules``);
- ``ulysses``: DeepSpeed-Ulysses sequence parallelism (``--ds-sequence-parallel-size``);
- ``expert_parallel``: expert parallelism on either DeepSpeed engine: the experts' gradients averaged, and their
  optimizer state sharded, over the expert-data-parallel group only;
- ``schedules``: the pipeline schedules' engines (interleaved 1F1B, ZB-H1) and ``ENGINE_CLASSES``, which engine class
  runs which schedule of the registry ``megatron.config.schedules``;
- ``load_checks``: after ``--load``, every weight, fp32 master and optimizer state finite, or an error naming it;
- ``timers``: per-phase wall-clock timers, leveled as Megatron-LM's (``--timing-log-level``).

Imports ``megatron.model`` and ``megatron.parallel``; nothing below it imports this package.
"""

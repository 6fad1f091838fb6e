"""Checkpoints: saving and resuming a run, merging any TP / PP, universal checkpoints, transformers conversion.

    tags          folder names and markers: ``latest``, ``complete``, which tag is read, pruning (plain files)
    training_io   save / load through DeepSpeed's engine, crash-safe; RNG states
    async_save    ``--async-save``: the state copied to host memory, written by a thread, then finished as training_io
    resume        which tag ``--load`` resumes from, whether it loads on this run's layout, the restore itself
    run_state     ``run_state.json``: the run's record (architecture, layout, tokenizer, progress), checks
    safe_load     reading a checkpoint file without running code
    integrity     ``checksums.json``: size and SHA-256 of every file, recorded at save, verified before loading
    lock          ``SAVE/.lock``: one run writes into a --save folder
    single_process any TP / PP -> full TP=1 GPTModel weights, and back to a training checkpoint
    universal     DeepSpeed universal checkpoints (subpackage): the converter's parameter patterns, renaming
                  for the other engine, MoE expert folders, the routers' expert biases
    hf            transformers model directories (subpackage): one module per family, one registry of them,
                  the shared safetensors and tokenizer I/O
    tp_shards     tensor-parallel shards of one parameter: merged into the full tensor, and split again
    zero_files    DeepSpeed's own checkpoint files: the classes they pickle, the weights its model engine saved
    expert_files  an MoE checkpoint's experts over expert-parallel ranks, for the single-process tools

Every converter reads ``megatron.model.layout`` for how parameters are laid out. Imports torch,
megatron.config, megatron.model and megatron.parallel; ``universal.patterns`` alone touches deepspeed (its
constants), so importing this package does not import deepspeed; ``hf.io`` imports transformers only inside
the functions that write or read a directory. Nothing here imports training/ or inference/.
"""

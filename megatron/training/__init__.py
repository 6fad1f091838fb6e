"""The training loop around the engine: set-up, train step, evaluation, logging (TensorBoard, W&B) and
exit signals. Uses ``megatron.engine``, ``megatron.checkpoint`` (saves and resumes) and
``megatron.data``; reads no flags itself (it is handed a ``RunConfig``).

    pretrain      ``pretrain(run_config)``: everything between the parsed flags and the trained model
    distributed   joining the job's process group, however it was launched
    data_iterators the run's datasets and data iterators, from its ``DataConfig`` (Megatron's sample counts)
    batches       from dataset samples to what the pipeline engine consumes
    microbatches  how many micro-batches make the current step: constant, or Megatron's batch-size rampup
    lr_schedule   the learning-rate schedule: Megatron's AnnealingLR
    token_count   --calculate-per-token-loss with a loss mask: the step's counted tokens, summed before the step
    loop          the training loop: one DeepSpeed pipeline step per iteration, evaluation, logging, exits, saves
    guards        what the loop checks of each iteration's loss and gradient norm: non-finite values, loss spikes
    exit          leaving cleanly: SIGTERM, the kill-switch file, --exit-duration-in-mins and --exit-interval
    metrics       the log line, the scalars (Megatron-DeepSpeed's tensorboard tag names) and the TFLOPs estimate
    log_writers   where the scalars go: TensorBoard and Weights & Biases behind one add_scalar
    timing        per-phase timers across ranks and memory for the log line, Megatron-LM's names
    profiling     the profiling window of --profile: nsys ranges or torch.profiler
    watchdog      --hang-watchdog-factor: a thread per rank that dumps the stacks of a hung step and ends the job
    restarts      in-job restarts under torchrun --max-restarts: how many, and the iterations each one lost
    straggler     --log-straggler: each rank's forward time gathered, the fastest and slowest ranks named
"""

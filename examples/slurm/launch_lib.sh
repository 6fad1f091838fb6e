# Sourced by the examples/slurm/*.slurm scripts: writes the job's DeepSpeed JSON from the same
# variables that make the flags (so the two always agree), then starts pretrain_gpt.py on every
# node of the allocation and forwards a SIGTERM sent to the batch shell to the workers.
#
#   source "$REPO/examples/slurm/launch_lib.sh"
#   write_ds_config "$LOGS_PATH/ds_config.$SLURM_JOB_ID.json"   # from MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE,
#                                                              # CLIP_GRAD, ZERO_STAGE, PRECISION
#   launch_pretrain "${ARGS[@]}"                               # the pretrain_gpt.py flags
#
# Variables read:
#   PY             the python that has the project installed (default: $REPO/.venv/bin/python)
#   LAUNCH_STYLE   torchrun (default, BLOOM's: one srun task per node, each running
#                  `python -m torch.distributed.run --nproc_per_node GPUS_PER_NODE`) or srun (one srun
#                  task per GPU running pretrain_gpt.py itself; ranks come from SLURM_PROCID)
#   GPUS_PER_NODE, NNODES   processes per node and nodes (NNODES defaults to SLURM_NNODES)
#   MASTER_PORT    rendezvous port on the first host (default: 6000 + SLURM_JOB_ID % 1000, so two jobs
#                  sharing a node do not collide)
#   SRUN_ARGS      extra srun options (an array-free string, e.g. "--overlap")
#   DRY_RUN        a file path: write "WORLD_SIZE\0flag\0flag\0..." there instead of launching (tests use
#                  this to check every generated flag set against megatron.arguments.run_config_from_argv)

write_ds_config() {
    local path=$1 precision
    if [[ ${PRECISION:-bf16} == bf16 && ${ZERO_STAGE:-1} -ge 2 ]]; then
        # ZeRO-2/3 keep their own fp32 master partitions (no BF16_Optimizer)
        precision='"bf16": {"enabled": true},'
    elif [[ ${PRECISION:-bf16} == bf16 ]]; then
        # fp32 gradient accumulation: with ZeRO stage 1 DeepSpeed then picks BF16_Optimizer (BLOOM's
        # optimizer: bf16 weights, fp32 master weights and Adam moments sharded over data parallelism)
        precision='"bf16": {"enabled": true},
  "data_types": {"grad_accum_dtype": "fp32"},'
    else
        # fp16 with dynamic loss scaling, the values of BigScience's V100 runs
        precision='"fp16": {"enabled": true, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
           "min_loss_scale": 1, "initial_scale_power": 12},'
    fi
    mkdir -p "$(dirname "$path")"
    cat > "$path" <<EOT
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": $CLIP_GRAD,
  "zero_optimization": {"stage": $ZERO_STAGE},
  $precision
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
EOT
}

launch_pretrain() {
    local nnodes=${NNODES:-${SLURM_NNODES:-1}}
    if [[ -n ${DRY_RUN:-} ]]; then
        printf '%s\0' "$(( nnodes * GPUS_PER_NODE ))" "$@" > "$DRY_RUN"
        return 0
    fi
    local py=${PY:-$REPO/.venv/bin/python}
    export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
    export MASTER_PORT=${MASTER_PORT:-$(( 6000 + SLURM_JOB_ID % 1000 ))}
    # --kill-on-bad-exit: one failed task ends the step instead of leaving the others hanging in a
    # collective; --wait=60: the others get 60 s to finish once the first task has exited.
    local srun_args=(--kill-on-bad-exit=1 --wait=60 ${SRUN_ARGS:-})
    local cmd
    if [[ ${LAUNCH_STYLE:-torchrun} == srun ]]; then
        srun "${srun_args[@]}" --nodes="$nnodes" --ntasks-per-node="$GPUS_PER_NODE" \
            "$py" -u "$REPO/pretrain_gpt.py" "$@" &
    else
        # torchrun itself must not react to SIGTERM: it would stop its workers and then exit 1 even when
        # they saved and exited 0. The workers get SIGTERM from SLURM directly (every process of the step
        # is signalled), so torchrun ignores it (`trap '' TERM` is inherited, and the workers install
        # their own handler) and handles only the other signals.
        cmd="trap '' TERM; exec $(printf '%q ' "$py" -u -m torch.distributed.run \
            --signals-to-handle SIGINT,SIGHUP,SIGQUIT \
            --nproc_per_node "$GPUS_PER_NODE" --nnodes "$nnodes" \
            --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --max_restarts 0) \
            --node_rank \$SLURM_PROCID $(printf '%q ' "$REPO/pretrain_gpt.py" "$@")"
        srun "${srun_args[@]}" --nodes="$nnodes" --ntasks-per-node=1 bash -c "$cmd" &
    fi
    local srun_pid=$!
    # A SIGTERM to the batch shell (`#SBATCH --signal=B:TERM@120`, `scancel --batch -s TERM`) is passed
    # to every task of the job's steps with scancel. NOT `kill $srun_pid`: srun answers SIGTERM by
    # killing its tasks with SIGKILL ("srun: forcing job termination"), and nothing would be saved.
    trap 'echo "$(date -u +%FT%TZ) batch shell got SIGTERM: signalling the workers of job $SLURM_JOB_ID"; \
          scancel --signal=TERM "$SLURM_JOB_ID"' TERM
    local rc=0
    wait "$srun_pid" || rc=$?
    while kill -0 "$srun_pid" 2>/dev/null; do  # `wait` returns early when a trapped signal arrives
        rc=0
        wait "$srun_pid" || rc=$?
    done
    trap - TERM
    echo "$(date -u +%FT%TZ) srun exited with $rc"
    return "$rc"
}

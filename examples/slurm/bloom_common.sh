# Sourced by the BLOOM scripts (bloom-176b.slurm, bloom-6b3.slurm, ...): the flags BigScience's tr11
# runs shared, built from the variables the model script sets, then the launch.
#
# The model script sets: EXPERIMENT, NLAYERS, NHIDDEN, NHEADS, SEQ_LEN, TP_SIZE, PP_SIZE, GPUS_PER_NODE,
# NNODES, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, RAMPUP_BATCH_SIZE ("START INCREMENT SAMPLES"), LR, MIN_LR,
# PRECISION (bf16 or fp16), CHECKPOINT_ACTIVATIONS (1 or 0), SAVE_INTERVAL, EXIT_DURATION_IN_MINS and
# optionally SYNC_TP_DUPLICATED_PARAMETERS=1.
#
# Paths (environment, all optional):
#   DATA_DIR                 default $REPO/data
#   TRAIN_DATA_PATH, VALID_DATA_PATH   files of weighted-split groups, one line of double-quoted
#                            "NAME: WEIGHT START:END PREFIX, ..." groups (what BigScience's
#                            load_ratios_meg_ds_format.py writes); default $DATA_DIR/{train,valid}-splits.txt
#   TOKENIZER_NAME_OR_PATH   a local tokenizer directory, or a hub name (bigscience/tokenizer) already in the
#                            local Hugging Face cache (nothing is downloaded); default $DATA_DIR/bloom-tokenizer
#   RUN_ROOT                 default $REPO/runs; checkpoints, tensorboard and logs go to $RUN_ROOT/$EXPERIMENT/...
#   VARIANT                  default main: a second variant of the same experiment gets its own
#                            checkpoint and tensorboard folders

source "$REPO/examples/slurm/launch_lib.sh"

VARIANT=${VARIANT:-main}
DATA_DIR=${DATA_DIR:-$REPO/data}
TRAIN_DATA_PATH=${TRAIN_DATA_PATH:-$DATA_DIR/train-splits.txt}
VALID_DATA_PATH=${VALID_DATA_PATH:-$DATA_DIR/valid-splits.txt}
TOKENIZER_NAME_OR_PATH=${TOKENIZER_NAME_OR_PATH:-$DATA_DIR/bloom-tokenizer}

DATA_OUTPUT_PATH=${RUN_ROOT:-$REPO/runs}/$EXPERIMENT
CHECKPOINT_PATH=$DATA_OUTPUT_PATH/checkpoints/$VARIANT
TENSORBOARD_PATH=$DATA_OUTPUT_PATH/tensorboard/$VARIANT
LOGS_PATH=$DATA_OUTPUT_PATH/logs/$VARIANT
# `touch` this file to make the run save and exit 0 at the next iteration (no new job starts training
# while it exists: each one saves and leaves after its first iteration).
KILL_SWITCH_PATH=${KILL_SWITCH_PATH:-$DATA_OUTPUT_PATH/kill-switch}
mkdir -p "$LOGS_PATH"

# BigScience's schedule for every tr11 model: 450B tokens, cosine decay over the first 410B, 375M
# tokens of warmup.
TRAIN_SAMPLES=220_000_000
LR_DECAY_SAMPLES=200_000_000
LR_WARMUP_SAMPLES=183_105
CLIP_GRAD=1.0
# ZeRO stage 0, as BigScience's flags and JSON said ("bf16 must use z0"): their DeepSpeed chose
# BF16_Optimizer (bf16 weights; fp32 master weights and Adam moments sharded over the data-parallel
# ranks) from bf16 alone. DeepSpeed 0.19.8 builds the same optimizer from stage 1 + fp32 gradient
# accumulation, so --bf16 --zero-stage 0 runs as stage 1 (a startup warning says so). fp16 runs
# (BigScience's smaller models on V100) used the unpartitioned FP16 optimizer, stage 0 as well.
ZERO_STAGE=${ZERO_STAGE:-0}

DS_CONFIG=$LOGS_PATH/ds_config.${SLURM_JOB_ID:-local}.json
write_ds_config "$DS_CONFIG"

read -r -a RAMPUP <<< "$RAMPUP_BATCH_SIZE"
ARGS=(
    --tensor-model-parallel-size "$TP_SIZE" --pipeline-model-parallel-size "$PP_SIZE"
    # the tied embedding counts as a layer on the first and last stage: BLOOM-176B's 70 layers + 2
    # embeddings split 6 per stage over 12 stages
    --pp-partition-method "type:transformer|embedding"
    --num-layers "$NLAYERS" --hidden-size "$NHIDDEN" --num-attention-heads "$NHEADS" --seq-length "$SEQ_LEN"
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --rampup-batch-size "${RAMPUP[@]}"
    --train-samples "$TRAIN_SAMPLES"
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$TOKENIZER_NAME_OR_PATH"
    --pad-vocab-size-to 250880
    --init-method-std 0.0048 --embed-layernorm --position-embedding-type alibi
    "--$PRECISION" --seed 42
    --abort-on-unmet-fused-kernel-constraints
    --kill-switch-path "$KILL_SWITCH_PATH"
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
    --lr-decay-samples "$LR_DECAY_SAMPLES" --lr-warmup-samples "$LR_WARMUP_SAMPLES"
    --clip-grad "$CLIP_GRAD" --weight-decay 1e-1
    --exit-duration-in-mins "$EXIT_DURATION_IN_MINS"
    --log-interval 1 --save-interval "$SAVE_INTERVAL" --eval-interval 1000 --eval-iters 1
    --tensorboard-dir "$TENSORBOARD_PATH" --tensorboard-queue-size 5
    --log-timers-to-tensorboard --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
    --train-weighted-split-paths-path "$TRAIN_DATA_PATH" --valid-weighted-split-paths-path "$VALID_DATA_PATH"
    --num-workers 2 --valid-num-workers 0 --data-impl mmap
    --distributed-backend nccl
    --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE"
)
if [[ ${CHECKPOINT_ACTIVATIONS:-1} == 1 ]]; then
    ARGS+=(--checkpoint-activations)
fi
if [[ ${SYNC_TP_DUPLICATED_PARAMETERS:-0} == 1 ]]; then
    ARGS+=(--sync-tp-duplicated-parameters)
fi

# Turn a hung collective into an error (after the process group's timeout) instead of a silent stall.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "START $(date -u +%FT%TZ) job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)}:" \
     "$EXPERIMENT, $NNODES nodes x $GPUS_PER_NODE GPUs, TP=$TP_SIZE PP=$PP_SIZE, resuming from $CHECKPOINT_PATH if it has a checkpoint"
# Everything the workers print also goes to the experiment's own log, which outlives the job's output file.
launch_pretrain "${ARGS[@]}" > >(tee -a "$LOGS_PATH/main_log.txt") 2>&1
echo "END $(date -u +%FT%TZ)"

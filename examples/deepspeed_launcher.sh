#!/usr/bin/env bash
# The DeepSpeed launcher with a hostfile: the launch style for clusters without SLURM (plain ssh).
# `deepspeed` reads the hostfile ("HOST slots=NUM_GPUS" per line), starts one process per slot on
# every host over pdsh/ssh (a single-host file starts them locally), and sets RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which pretrain_gpt.py reads.
#
#   examples/deepspeed_launcher.sh [extra pretrain_gpt.py flags...]
#
# Environment (all optional):
#   PY                   python with the project installed (default .venv/bin/python); `deepspeed` is
#                        run as `$PY -m deepspeed.launcher.runner`, the same program as the `deepspeed` command
#   HOSTFILE             default: a one-line file "localhost slots=$NPROC" written under RUN_DIR
#   NPROC                slots of the default hostfile (default 2)
#   MASTER_ADDR          the first host of the hostfile as the others reach it (default 127.0.0.1)
#   TP, PP               (default 1 and 2); the world size (total slots) must be a multiple of TP x PP
#   TRAIN_ITERS, RUN_DIR, DATA_PREFIX, VOCAB_FILE, MERGE_FILE, PRECISION   as in train_tiny_torchrun.sh
#   DRY_RUN              a file path: write "WORLD_SIZE\0flag\0..." there instead of launching
# Multi-node: every host needs passwordless ssh from the first one, pdsh, the same paths, and the
# variables listed in a ~/.deepspeed_env file if they must reach the remote processes.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-2}
TP=${TP:-1}
PP=${PP:-2}
TRAIN_ITERS=${TRAIN_ITERS:-50}
RUN_DIR=${RUN_DIR:-runs/tiny-deepspeed-launcher}
mkdir -p "$RUN_DIR"

LAUNCHER_ARGS=()
if [[ -z ${HOSTFILE:-} ]]; then
    HOSTFILE=$RUN_DIR/hostfile
    echo "localhost slots=$NPROC" > "$HOSTFILE"
    # one local host: processes start locally, so skip the launcher's ssh reachability check
    LAUNCHER_ARGS+=(--no_ssh_check)
fi
# World size: the slots of the hostfile's hosts.
WORLD_SIZE=$(awk '!/^[[:space:]]*(#|$)/ { for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { sub("slots=", "", $i); n += $i } } END { print n }' "$HOSTFILE")

if [[ -z ${DATA_PREFIX:-} ]]; then
    "$PY" tools/prepare_default_corpus.py --output-dir data_cache/default_corpus >/dev/null
    DATA_PREFIX=data_cache/default_corpus/corpus_text_document
    VOCAB_FILE=data_cache/default_corpus/tokenizer/vocab.json
    MERGE_FILE=data_cache/default_corpus/tokenizer/merges.txt
fi

MICRO_BATCH_SIZE=2
GLOBAL_BATCH_SIZE=$(( MICRO_BATCH_SIZE * WORLD_SIZE / (TP * PP) * 2 ))
ZERO_STAGE=1
source examples/precision.sh
choose_precision "$PY"
# The DeepSpeed JSON of this run, from the same values as the flags below (they must agree: a key that
# contradicts a flag is refused before anything starts).
DS_CONFIG=$RUN_DIR/ds_config.json
BF16_KEYS=""
if [ "$PRECISION" = bf16 ]; then
    BF16_KEYS=$',\n  "bf16": {"enabled": true},\n  "data_types": {"grad_accum_dtype": "fp32"}'
fi
cat > "$DS_CONFIG" <<EOT
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {"stage": $ZERO_STAGE}$BF16_KEYS
}
EOT

BACKEND=${BACKEND:-$("$PY" -c "import torch; print('nccl' if torch.cuda.is_available() else 'gloo')")}
ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" --train-iters "$TRAIN_ITERS"
    --position-embedding-type alibi --embed-layernorm ${PRECISION_FLAGS[@]+"${PRECISION_FLAGS[@]}"}
    --init-method-std 0.02 --hidden-dropout 0.0 --attention-dropout 0.0 --seed 42
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters $(( TRAIN_ITERS / 5 ))
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    --data-path "$DATA_PREFIX" --split 949,50,1
    --num-workers 0 --valid-num-workers 0 --distributed-backend "$BACKEND"
    --log-interval 5 --eval-interval 1000 --eval-iters 1
    --tensorboard-dir "$RUN_DIR/tensorboard"
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 25
    --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE"
    "$@"
)
if [[ -n ${DRY_RUN:-} ]]; then
    printf '%s\0' "$WORLD_SIZE" "${ARGS[@]}" > "$DRY_RUN"
    exit 0
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" "${LAUNCHER_ARGS[@]}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29600}" \
    pretrain_gpt.py "${ARGS[@]}"

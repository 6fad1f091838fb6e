#!/usr/bin/env bash
# A tiny BLOOM-style model (2 layers, hidden 64, ALiBi, embedding LayerNorm, ZeRO-1) on one machine with
# torchrun: the smallest complete run, to check an installation or a cluster node. bf16 where the hardware
# has bf16 instructions (AVX-512 BF16 / AMX, or a GPU), fp32 otherwise (examples/precision.sh).
# CPU (gloo) or GPU (NCCL: picked when CUDA is present; set NPROC to the GPU count).
#
#   examples/train_tiny_torchrun.sh [extra pretrain_gpt.py flags...]
#
# Environment (all optional):
#   PY           python with the project installed (default .venv/bin/python)
#   NPROC        processes (default 2); TP * PP must divide it, DP = NPROC / (TP * PP)
#   TP, PP       tensor / pipeline parallel sizes (default 1 and 2)
#   TRAIN_ITERS  iterations (default 50); SAVE_INTERVAL (default 25)
#   PRECISION    auto (default), bf16 or fp32
#   RUN_DIR      checkpoints and tensorboard go under it (default runs/tiny-torchrun)
#   DATA_PREFIX, VOCAB_FILE, MERGE_FILE  a Megatron .bin/.idx prefix and its GPT-2 BPE tokenizer files;
#                default: the offline corpus built by tools/prepare_default_corpus.py
# Rerunning the script continues from the last checkpoint (--load is --save).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-2}
TP=${TP:-1}
PP=${PP:-2}
TRAIN_ITERS=${TRAIN_ITERS:-50}
SAVE_INTERVAL=${SAVE_INTERVAL:-25}
RUN_DIR=${RUN_DIR:-runs/tiny-torchrun}

if [[ -z "${DATA_PREFIX:-}" ]]; then
    CORPUS_DIR=${CORPUS_DIR:-data_cache/default_corpus}
    "$PY" tools/prepare_default_corpus.py --output-dir "$CORPUS_DIR" >/dev/null
    DATA_PREFIX=$CORPUS_DIR/corpus_text_document
    VOCAB_FILE=$CORPUS_DIR/tokenizer/vocab.json
    MERGE_FILE=$CORPUS_DIR/tokenizer/merges.txt
fi

BACKEND=${BACKEND:-$("$PY" -c "import torch; print('nccl' if torch.cuda.is_available() else 'gloo')")}
source examples/precision.sh
choose_precision "$PY"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$RUN_DIR"

# MBS 2 x DP x 2 micro-batches per step: the global batch follows the process count.
DP=$(( NPROC / (TP * PP) ))
GBS=$(( 2 * DP * 2 ))

"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --micro-batch-size 2 --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS" \
    --position-embedding-type alibi --embed-layernorm ${PRECISION_FLAGS[@]+"${PRECISION_FLAGS[@]}"} --zero-stage 1 \
    --init-method-std 0.02 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.1 --clip-grad 1.0 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters $(( TRAIN_ITERS / 5 )) \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --data-path "$DATA_PREFIX" --split 949,50,1 \
    --num-workers 0 --valid-num-workers 0 --distributed-backend "$BACKEND" --seed 42 \
    --log-interval 5 --eval-interval 1000 --eval-iters 2 \
    --tensorboard-dir "$RUN_DIR/tensorboard" --log-validation-ppl-to-tensorboard \
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval "$SAVE_INTERVAL" \
    "$@"

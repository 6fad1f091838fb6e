#!/usr/bin/env bash
# A small mixture-of-experts model on 4 CPU processes laid out PP=2 x DP=2 with expert parallelism EP=2 (each
# data-parallel rank holds 2 of every MoE layer's 4 experts and the ranks exchange tokens all-to-all): the
# Llama-style block of pretrain_tiny_llama_cpu.sh (RMSNorm, SwiGLU, rotary, GQA, no biases, untied head) with a
# dense first layer as DeepSeek-V3 has, then three MoE layers of 4 SwiGLU experts (top-2, dropless), a shared
# expert, the load-balancing loss and the aux-loss-free expert bias. ZeRO-1: BF16_Optimizer in bf16, where the
# hardware has bf16 instructions, fp32 elsewhere (examples/precision.sh). The per-expert load, the balancing
# losses and the dropped fraction go to tensorboard under moe/.
#
#   examples/pretrain_tiny_moe_cpu.sh [extra pretrain_gpt.py flags...]
#
# Environment (all optional):
#   PY           python with the project installed (default .venv/bin/python)
#   NPROC        processes (default 4); TP x PP must divide it, DP = NPROC / (TP x PP), EP must divide DP
#   TP, PP, EP   tensor / pipeline / expert parallel sizes (default 1, 2 and 2; EP must divide the 4 experts)
#   TRAIN_ITERS  iterations (default 200); SAVE_INTERVAL (default 100)
#   PRECISION    auto (default: as above, one line at start says which and why), bf16 or fp32
#   RUN_DIR      checkpoints and tensorboard go under it (default runs/tiny-moe)
#   DATA_PREFIX, VOCAB_FILE, MERGE_FILE  a Megatron .bin/.idx prefix and its GPT-2 BPE tokenizer files;
#                default: the offline corpus built by tools/prepare_default_corpus.py
# Rerunning the script continues from the last checkpoint (--load is --save).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-4}
TP=${TP:-1}
PP=${PP:-2}
EP=${EP:-2}
TRAIN_ITERS=${TRAIN_ITERS:-200}
SAVE_INTERVAL=${SAVE_INTERVAL:-100}
RUN_DIR=${RUN_DIR:-runs/tiny-moe}

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

# MBS 4 x DP x 4 micro-batches per step: the global batch follows the process count (32 at DP=2).
DP=$(( NPROC / (TP * PP) ))
GBS=$(( 4 * DP * 4 ))

"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 8 --num-key-value-heads 4 --seq-length 128 \
    --ffn-hidden-size 352 --normalization rmsnorm --norm-epsilon 1e-5 --swiglu \
    --position-embedding-type rope --rotary-base 10000 --disable-bias-linear --untie-embeddings-and-output-weights \
    --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 128 \
    --moe-layer-freq "[0,1,1,1]" --moe-aux-loss-coeff 0.01 --moe-router-enable-expert-bias \
    --micro-batch-size 4 --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS" \
    ${PRECISION_FLAGS[@]+"${PRECISION_FLAGS[@]}"} --zero-stage 1 \
    --init-method-std 0.02 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --weight-decay 0.1 --clip-grad 1.0 \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters $(( TRAIN_ITERS / 10 )) \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --data-path "$DATA_PREFIX" --split 949,50,1 \
    --num-workers 0 --valid-num-workers 0 --distributed-backend "$BACKEND" --seed 42 \
    --log-interval 10 --eval-interval 100 --eval-iters 5 \
    --tensorboard-dir "$RUN_DIR/tensorboard" --log-validation-ppl-to-tensorboard \
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval "$SAVE_INTERVAL" \
    "$@"

echo
echo "Done. Tensorboard logs: $RUN_DIR/tensorboard   (view: $PY -m tensorboard.main --logdir $RUN_DIR/tensorboard)"
echo "Checkpoints:     $RUN_DIR/checkpoints (latest: $(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null || echo none))"

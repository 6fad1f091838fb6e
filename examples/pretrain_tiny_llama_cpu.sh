#!/usr/bin/env bash
# A small Llama-style model (RMSNorm, SwiGLU, rotary, grouped-query attention with 4 key / value heads
# for 8 query heads, no biases, untied output head; ZeRO-1) on 8 processes laid out TP=2 x PP=2 x DP=2:
# the BLOOM job of `make pretrain` (pretrain_tiny_bloom_cpu.sh) with Llama's block. Like that job it
# trains in bf16 (BF16_Optimizer) where the hardware has bf16 instructions (AVX-512 BF16 / AMX, or a
# GPU) and in fp32 where it has not (AVX2 only, where bf16 is about 17x slower; examples/precision.sh).
# Runs unchanged on a GPU node: set NPROC to the GPU count; NCCL is chosen when CUDA is present.
#
#   examples/pretrain_tiny_llama_cpu.sh [extra pretrain_gpt.py flags...]
#
# Environment (all optional):
#   PY           python with the project installed (default .venv/bin/python)
#   NPROC        processes (default 8); TP x PP must divide it, DP = NPROC / (TP x PP)
#   TP, PP       tensor / pipeline parallel sizes (default 2 and 2; TP must divide the 4 key / value heads)
#   TRAIN_ITERS  iterations (default 300); SAVE_INTERVAL (default 100)
#   PRECISION    auto (default: as above, one line at start says which and why), bf16 or fp32
#   ZERO_STAGE   1 (default: BF16_Optimizer, ZeRO-1), or 2 / 3 (gradients / parameters sharded too; PP=1):
#                e.g. ZERO_STAGE=3 NPROC=4 TP=2 PP=1 (docs/parallelism.md)
#   RUN_DIR      checkpoints and tensorboard go under it (default runs/tiny-llama)
#   DATA_PREFIX, VOCAB_FILE, MERGE_FILE  a Megatron .bin/.idx prefix and its GPT-2 BPE tokenizer files;
#                default: the offline corpus built by tools/prepare_default_corpus.py
# Rerunning the script continues from the last checkpoint (--load is --save). The checkpoint exports
# to a LlamaForCausalLM: tools/convert_checkpoint/to_hf.py --load RUN_DIR/checkpoints --output-dir DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-8}
TP=${TP:-2}
PP=${PP:-2}
TRAIN_ITERS=${TRAIN_ITERS:-300}
ZERO_STAGE=${ZERO_STAGE:-1}
SAVE_INTERVAL=${SAVE_INTERVAL:-100}
RUN_DIR=${RUN_DIR:-runs/tiny-llama}

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
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 8 --num-key-value-heads 4 --seq-length 128 \
    --ffn-hidden-size 352 --normalization rmsnorm --norm-epsilon 1e-5 --swiglu \
    --position-embedding-type rope --rotary-base 10000 --disable-bias-linear --untie-embeddings-and-output-weights \
    --micro-batch-size 4 --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS" \
    ${PRECISION_FLAGS[@]+"${PRECISION_FLAGS[@]}"} --zero-stage "$ZERO_STAGE" \
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

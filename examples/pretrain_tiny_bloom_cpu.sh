#!/usr/bin/env bash
# The main job (`make pretrain`): a small BLOOM-style model (ALiBi, embedding LayerNorm, ZeRO-1
# sharded optimizer state) on 8 processes laid out TP=2 x PP=2 x DP=2, trained on a corpus built
# from the documentation installed on this machine. bf16 (BF16_Optimizer) where the hardware has
# bf16 instructions (AVX-512 BF16 / AMX, or a GPU), fp32 otherwise, where bf16 would be about 17x
# slower; one line at start says which and why. The same script runs unchanged on a GPU node: set
# NPROC to the GPU count; NCCL is chosen when CUDA is present.
#
#   examples/pretrain_tiny_bloom_cpu.sh [extra pretrain_gpt.py flags...]
#
# Environment: PYTHON (default .venv/bin/python), RUN_DIR (default runs/tiny-bloom), NPROC (8),
# TRAIN_ITERS (300), PRECISION (auto, bf16 or fp32).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
RUN_DIR=${RUN_DIR:-runs/tiny-bloom}
NPROC=${NPROC:-8}
TRAIN_ITERS=${TRAIN_ITERS:-300}
CORPUS_DIR=${CORPUS_DIR:-data_cache/default_corpus}

# 1. The corpus: docstrings and docs of the installed Python and packages, a byte-level BPE
#    trained on them, and Megatron's .bin/.idx (reused when already complete).
"$PYTHON" tools/prepare_default_corpus.py --output-dir "$CORPUS_DIR" >/dev/null
TOK="$CORPUS_DIR/tokenizer"

BACKEND=$("$PYTHON" -c "import torch; print('nccl' if torch.cuda.is_available() else 'gloo')")
source examples/precision.sh
choose_precision "$PYTHON"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

mkdir -p "$RUN_DIR"
# 2. Train. With --load pointing at --save, rerunning the script continues the run.
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 8 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters "$TRAIN_ITERS" \
    --position-embedding-type alibi --embed-layernorm ${PRECISION_FLAGS[@]+"${PRECISION_FLAGS[@]}"} --zero-stage 1 \
    --pp-partition-method "type:transformer|embedding" \
    --init-method-std 0.02 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.1 --clip-grad 1.0 \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 30 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$TOK/vocab.json" --merge-file "$TOK/merges.txt" \
    --data-path "$CORPUS_DIR/corpus_text_document" --split 949,50,1 \
    --num-workers 0 --valid-num-workers 0 --distributed-backend "$BACKEND" --seed 42 \
    --log-interval 10 --eval-interval 100 --eval-iters 5 \
    --tensorboard-dir "$RUN_DIR/tensorboard" --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard \
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 100 \
    "$@"

echo
echo "Done. Tensorboard logs: $RUN_DIR/tensorboard   (view: $PYTHON -m tensorboard.main --logdir $RUN_DIR/tensorboard)"
echo "Checkpoints:     $RUN_DIR/checkpoints (latest: $(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null || echo none))"

#!/usr/bin/env bash
# A small mixture-of-experts model on 4 CPU processes laid out PP=2 x DP=2 with expert parallelism EP=2 (each
# data-parallel rank holds 2 of every MoE layer's 4 experts and the ranks exchange tokens all-to-all): the
# Llama-style job of pretrain_tiny_llama_cpu.sh (RMSNorm, SwiGLU, rotary, GQA, no biases, untied head; bf16 with
# BF16_Optimizer where the hardware has bf16 instructions, fp32 elsewhere) with a dense first layer as
# DeepSeek-V3 has, then three MoE layers of 4 SwiGLU experts of width 128 (top-2, dropless), a shared expert, the
# load-balancing loss and the aux-loss-free expert bias. The per-expert load, the balancing losses and the dropped
# fraction go to tensorboard under moe/.
#
#   examples/pretrain_tiny_moe_cpu.sh [extra pretrain_gpt.py flags...]
#
# Environment (all optional; the rest as pretrain_tiny_llama_cpu.sh reads it: PY, PRECISION, SAVE_INTERVAL,
# DATA_PREFIX, VOCAB_FILE, MERGE_FILE):
#   NPROC        processes (default 4); TP x PP must divide it, DP = NPROC / (TP x PP), EP must divide DP
#   TP, PP, EP   tensor / pipeline / expert parallel sizes (default 1, 2 and 2; EP must divide the 4 experts)
#   TRAIN_ITERS  iterations (default 200)
#   RUN_DIR      checkpoints and tensorboard go under it (default runs/tiny-moe)
# Rerunning the script continues from the last checkpoint (--load is --save).
set -euo pipefail
cd "$(dirname "$0")/.."

export NPROC=${NPROC:-4} TP=${TP:-1} PP=${PP:-2} TRAIN_ITERS=${TRAIN_ITERS:-200} RUN_DIR=${RUN_DIR:-runs/tiny-moe}
EP=${EP:-2}

exec bash examples/pretrain_tiny_llama_cpu.sh --expert-model-parallel-size "$EP" \
    --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 128 \
    --moe-layer-freq "[0,1,1,1]" --moe-aux-loss-coeff 0.01 --moe-router-enable-expert-bias \
    "$@"

"""The flags of real upstream launch scripts, as their shell expands them, with only the data, tokenizer,
checkpoint and log paths replaced by ``{tmp}`` placeholders (the test fills them in).

Each entry: the script it comes from (repository, path, commit read), the world size it launches, and its
argv for ``pretrain_gpt.py``. Shell-only pieces (torchrun's own flags, ``mkdir``, the DeepSpeed JSON the script
writes with ``cat <<EOT``) are left out; where a script writes a DeepSpeed JSON, ``ds_config`` holds its content
and ``{ds_config}`` its path.
"""

from __future__ import annotations

MEGATRON_LM = "NVIDIA/Megatron-LM@d98e8a64dd"
MEGATRON_DS = "deepspeedai/Megatron-DeepSpeed@4efb479d"
MOE_ZOO = "yanring/Megatron-MoE-ModelZoo@bff12290"

SCRIPTS = {
    # examples_deepspeed/pretrain_llama2_distributed.sh: TP=2, PP=2, ZeRO 0, 8 GPUs, activation_checkpoint false,
    # LOG_TO_WANDB=0
    "mds_llama2": dict(
        source=f"{MEGATRON_DS}:examples_deepspeed/pretrain_llama2_distributed.sh", world_size=8,
        ds_config={"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
                   "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}},
        argv="""
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 2048
        --ffn-hidden-size 5504 --num-attention-heads 16 --micro-batch-size 4 --global-batch-size 32
        --seq-length 2048 --max-position-embeddings 2048 --train-iters 250000 --save {tmp}/ckpt --load {tmp}/ckpt
        --data-path 1 {tmp}/data/corpus_text_document --data-impl mmap
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {tmp}/tokenizer.model --split 949,50,1
        --distributed-backend nccl --lr 3e-4 --lr-decay-style cosine --min-lr 3e-5 --weight-decay 0.1
        --clip-grad 1 --lr-warmup-iters 2000 --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95
        --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --bf16
        --no-query-key-layer-scaling --attention-dropout 0 --hidden-dropout 0 --use-rotary-position-embeddings
        --untie-embeddings-and-output-weights --swiglu --normalization rmsnorm --disable-bias-linear
        --num-key-value-heads 4 --zero-stage=0 --deepspeed_config={ds_config} --deepspeed
        """),
    # examples_deepspeed/universal_checkpointing/llama/run_llama_bf16.sh: TP=2, PP=2, DP=2, SP=1, ZeRO 1,
    # DEBUG_MODE=1 (exit interval 200), the script's own $@ empty
    "mds_universal_llama": dict(
        source=f"{MEGATRON_DS}:examples_deepspeed/universal_checkpointing/llama/run_llama_bf16.sh", world_size=8,
        ds_config={"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
                   "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "wall_clock_breakdown": False},
        argv="""
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --ds-sequence-parallel-size 1
        --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5504 --num-attention-heads 16 --micro-batch-size 4
        --global-batch-size 32 --seq-length 2048 --max-position-embeddings 2048 --train-iters 250000
        --save {tmp}/ckpt --load {tmp}/ckpt --data-path {tmp}/data/corpus_text_document --data-impl mmap
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {tmp}/tokenizer.model --split 949,50,1
        --distributed-backend nccl --lr 3e-4 --lr-decay-style cosine --min-lr 3e-5 --weight-decay 0.1
        --clip-grad 1 --lr-warmup-iters 2000 --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95
        --log-interval 1 --save-interval 100 --eval-interval 10 --eval-iters 40 --exit-interval 200 --bf16
        --no-query-key-layer-scaling --attention-dropout 0 --hidden-dropout 0 --use-rotary-position-embeddings
        --untie-embeddings-and-output-weights --swiglu --normalization rmsnorm --disable-bias-linear
        --tensorboard-dir {tmp}/tb --zero-stage=1 --deepspeed_config={ds_config} --deepspeed
        """),
    # examples_deepspeed/zero_bubble_pp/zbh1_pretrain_gpt_1.3b.sh: GPT-3 XL, PP=8, TP=1, ZeRO 0, fp16, on 16 GPUs
    # (the script takes every GPU of its hosts; two 8-GPU nodes here), activation_checkpoint false,
    # log_optimizer_state true; its DeepSpeed JSON comes from ../rebase/ds_config_gpt_TEMPLATE.json
    "mds_zbh1": dict(
        source=f"{MEGATRON_DS}:examples_deepspeed/zero_bubble_pp/zbh1_pretrain_gpt_1.3b.sh", world_size=16,
        ds_config={"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
                   "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0, "prescale_gradients": True,
                   "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                            "min_loss_scale": 1, "initial_scale_power": 11},
                   "wall_clock_breakdown": False},
        argv="""
        --override-opt_param-scheduler --adam-beta1 0.9 --adam-beta2 0.95 --tensor-model-parallel-size 1
        --init-method-std 0.013 --lr-decay-tokens 300000000000 --lr-warmup-tokens 3000000000 --micro-batch-size 1
        --exit-duration-in-mins 30000000 --global-batch-size 16 --num-layers 24 --hidden-size 2048
        --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --train-tokens 300000000000
        --train-samples 292968750 --lr 2.0e-4 --min-lr 1.0e-6 --lr-decay-style cosine --split 949,50,1
        --log-interval 1 --eval-interval 10100 --eval-iters 10100 --save-interval 10100 --weight-decay 0.1
        --clip-grad 1.0 --hysteresis 2 --num-workers 0 --fp16 --seed 1234 --load {tmp}/ckpt --save {tmp}/ckpt
        --no-async-tensor-model-parallel-allreduce --tensorboard-queue-size 1 --log-timers-to-tensorboard
        --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard --tensorboard-dir {tmp}/tb
        --log-optimizer-states-to-tensorboard
        --vocab-file {tmp}/gpt2-vocab.json --merge-file {tmp}/gpt2-merges.txt
        --data-path {tmp}/data/corpus_text_document --data-impl mmap
        --deepspeed --deepspeed_config {ds_config} --zero-stage 0 --enable-zbh1-pipeline
        --enable-zbh1-exact-semantics --pipeline-model-parallel-size 8
        """),
    # examples/llama/train_llama3_8b_h100_fp8.sh: 8 GPUs, TP=1, CP=1, real data (HuggingFaceTokenizer), DTYPE=fp8
    "mlm_llama3_8b": dict(
        source=f"{MEGATRON_LM}:examples/llama/train_llama3_8b_h100_fp8.sh", world_size=8, ds_config=None,
        argv="""
        --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
        --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
        --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
        --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134
        --attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
        --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
        --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
        --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
        --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
        --empty-unused-memory-level 1 --exit-duration-in-mins 235
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
        --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
        --data-path {tmp}/data/corpus_text_document --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model {tmp}/hf_tokenizer --data-cache-path {tmp}/cache --split '99,1,0'
        --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --vocab-size 128256
        --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
        --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
        --save {tmp}/ckpt --load {tmp}/ckpt --tensorboard-dir {tmp}/tb
        """),
    # examples/mixtral/train_mixtral_8x7b_distributed.sh: 4 nodes of 8 GPUs (SLURM_NNODES=4: EP=8 over PP=4 needs
    # 32 ranks), WANDB_API_KEY unset
    "mlm_mixtral_8x7b": dict(
        source=f"{MEGATRON_LM}:examples/mixtral/train_mixtral_8x7b_distributed.sh", world_size=32, ds_config=None,
        argv="""
        --use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
        --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
        --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope
        --swiglu --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8
        --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
        --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
        --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
        --tokenizer-type Llama2Tokenizer --tokenizer-model {tmp}/tokenizer.model
        --data-path {tmp}/data/corpus_text_document --split 99990,8,2
        --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
        --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
        --use-distributed-optimizer --sequence-parallel
        --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save {tmp}/ckpt
        --load {tmp}/ckpt --tensorboard-dir {tmp}/ckpt/tensorboard --no-load-optim --no-load-rng
        """),
    # Megatron-MoE-ModelZoo's DeepSeek-V3 H100 recipe (best_practice/deepseek-v3/run_deepseek_v3_h100.sh, the same
    # lines as DeepSeekV3/run.sh at c1ad0b5c): its first command, "A2A_OVERLAP=1 PP=8 VPP=4 TP=2 EP=64 NNODES=128
    # GBS=8192 PR=fp8 bash sbatch_benchmarking.sh <its flags>", expanded as that script does: the MODEL_ARGS of
    # model_configs/benchmarking/DeepSeek-V3.yaml in order (envsubst, then yq: "true" -> the bare flag, "false"
    # dropped: --finetune, --log-num-zeros-in-grad, --log-params-norm), then the recipe's own flags, then the
    # script's: DISPATCHER unset -> deepep (flex), PR=fp8 -> blockwise FP8 and the precision-aware optimizer,
    # A2A_OVERLAP=1 -> --delay-wgrad-compute --overlap-moe-expert-parallel-comm. The layout names the virtual stages,
    # so no --num-virtual-stages-per-pipeline-rank and no --decoder-first/last (61 % 8 != 0 but a layout is given);
    # SEQ_LEN 4096 = --max-position-embeddings adds nothing. MCORE_RELEASE_VERSION and COMMENT are empty, so
    # common.conf's defaults name the wandb project and run. 128 nodes x 8 GPUs; the shell's word splitting
    # drops the layout's quotes. DATA_PATH, LOAD_PATH, OUTPUT_PATH and WORKSPACE (cluster config) -> {tmp}.
    "moe_zoo_deepseek_v3_h100": dict(
        source=f"{MOE_ZOO}:best_practice/deepseek-v3/run_deepseek_v3_h100.sh", world_size=1024, ds_config=None,
        argv="""
        --distributed-timeout-minutes 60 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8
        --expert-model-parallel-size 64 --context-parallel-size 1 --expert-tensor-parallel-size 1
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear --micro-batch-size 1
        --global-batch-size 8192 --train-samples 585937500 --exit-duration-in-mins 220 --no-save-optim
        --no-check-for-nan-in-loss-and-grad --cross-entropy-loss-fusion --cross-entropy-fusion-impl native
        --manual-gc --manual-gc-interval 10 --transformer-impl transformer_engine
        --seq-length 4096 --data-cache-path {tmp}/data_cache --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model {tmp}/deepseek_v3_tokenizer --data-path {tmp}/data/corpus_text_document --split 99,1,0
        --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6
        --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
        --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000
        --make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
        --untie-embeddings-and-output-weights --multi-latent-attention
        --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm
        --lr-decay-samples 584765624 --lr-warmup-samples 1536000 --lr-warmup-init 3.9e-7 --lr 3.9e-6
        --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
        --num-experts 256 --moe-layer-freq ([0]*3+[1]*58) --moe-ffn-hidden-size 2048
        --moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss --moe-router-topk 8
        --moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4 --moe-router-num-groups 8
        --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
        --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion --moe-router-fusion
        --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
        --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
        --eval-iters 32 --eval-interval 200
        --no-load-optim --no-load-rng --auto-detect-ckpt-format --load {tmp}/ckpt --save {tmp}/out/checkpoints
        --save-interval 500 --dist-ckpt-strictness log_all --init-method-std 0.02
        --log-timers-to-tensorboard --log-memory-to-tensorboard --log-validation-ppl-to-tensorboard
        --log-throughput --log-interval 1 --logging-level 40 --tensorboard-dir {tmp}/out/tensorboard
        --wandb-project moe-benchmarking-vyour_own_megatron_version
        --wandb-exp-name DeepSeek-V3-TP2PP8EP64CP1VPP4-MBS1GBS8192-vyour_own_megatron_version
        --bf16 --enable-experimental
        --recompute-granularity selective --recompute-modules mla_up_proj mlp
        --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --pipeline-model-parallel-layout Et|(tt|)*30mL
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep
        --fp8-recipe blockwise --fp8-format e4m3 --fp8-param-gather --use-precision-aware-optimizer
        --main-grads-dtype fp32 --main-params-dtype fp32 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
        --moe-router-padding-for-fp8 --delay-wgrad-compute --overlap-moe-expert-parallel-comm
        """),
    # Megatron-MoE-ModelZoo's Qwen3-235B-A22B H100 recipe (best_practice/qwen3/run_h100_235b.sh): "DISPATCHER=deepep
    # A2A_OVERLAP=1 TP=2 PP=8 VPP=4 EP=32 NNODES=32 GBS=2048 bash ./sbatch_benchmarking.sh <its flags>" with PR unset
    # (bf16), expanded as that script does: the MODEL_ARGS of model_configs/benchmarking/Qwen3-235B-A22B.yaml in
    # order (envsubst: LAYERS_PER_VP = 96 / PP / VPP = 3 from runtime.conf's 96 "layers" that count the embedding
    # and the loss; yq: "true" -> the bare flag, "false" dropped: --moe-router-pre-softmax), then the recipe's own
    # flags, then the script's: deepep (flex), PR=bf16 -> --tp-comm-overlap, A2A_OVERLAP=1 -> --delay-wgrad-compute
    # --overlap-moe-expert-parallel-comm. --num-layers-per-virtual-pipeline-stage is given, so no
    # --num-virtual-stages-per-pipeline-rank; 96 % 8 == 0, so no --decoder-first/last. MCORE_RELEASE_VERSION unset
    # (sbatch's default names the wandb project), COMMENT=baseline. 32 nodes x 8 GPUs. DATA_PATH, LOAD_PATH,
    # OUTPUT_PATH and WORKSPACE (cluster config) -> {tmp}.
    "moe_zoo_qwen3_235b_h100": dict(
        source=f"{MOE_ZOO}:best_practice/qwen3/run_h100_235b.sh", world_size=256, ds_config=None,
        argv="""
        --distributed-timeout-minutes 220 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8
        --num-layers-per-virtual-pipeline-stage 3 --expert-model-parallel-size 32 --context-parallel-size 1
        --expert-tensor-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --no-create-attention-mask-in-dataloader --account-for-embedding-in-pipeline-split
        --account-for-loss-in-pipeline-split
        --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear --micro-batch-size 1
        --global-batch-size 2048 --train-samples 268554688 --exit-duration-in-mins 230 --manual-gc
        --manual-gc-interval 5 --cross-entropy-loss-fusion --cross-entropy-fusion-impl te --enable-experimental
        --transformer-impl transformer_engine
        --data-cache-path {tmp}/data_cache --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp}/qwen3_tokenizer
        --data-path {tmp}/data/corpus_text_document --split 99,1,0 --no-mmap-bin-files --num-workers 6
        --untie-embeddings-and-output-weights --position-embedding-type rope --rotary-percent 1.0
        --rotary-base 1000000 --rotary-seq-len-interpolation-factor 1 --normalization RMSNorm --swiglu
        --norm-epsilon 1e-06 --num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 64
        --kv-channels 128 --group-query-attention --num-query-groups 4 --qk-layernorm --seq-length 4096
        --max-position-embeddings 4096 --make-vocab-size-divisible-by 1187
        --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1
        --lr-decay-samples 584765624 --lr-warmup-samples 1536000 --lr-warmup-init 3.9e-7 --lr 3.9e-6
        --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
        --num-experts 128 --moe-ffn-hidden-size 1536 --moe-router-load-balancing-type aux_loss --moe-router-topk 8
        --moe-grouped-gemm --moe-aux-loss-coeff 1e-3 --moe-permute-fusion --moe-router-fusion --moe-router-dtype fp32
        --eval-iters 32 --eval-interval 500
        --finetune --auto-detect-ckpt-format --load {tmp}/ckpt --no-load-rng --no-load-optim
        --save {tmp}/out/checkpoints --save-interval 100 --dist-ckpt-strictness log_all --init-method-std 0.02
        --log-timers-to-tensorboard --log-memory-to-tensorboard --log-validation-ppl-to-tensorboard
        --log-throughput --log-interval 1 --logging-level 40 --tensorboard-dir {tmp}/out/tensorboard
        --wandb-project moe-benchmarking-vyour_own_megatron_version
        --wandb-exp-name Qwen3-235B-A22B-TP2PP8EP32CP1VPP4-MBS1GBS2048-baseline --bf16
        --recompute-granularity selective --recompute-modules moe_act layernorm --moe-router-force-load-balancing
        --cuda-graph-impl transformer_engine --cuda-graph-scope moe_router moe_preprocess
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep --tp-comm-overlap
        --delay-wgrad-compute --overlap-moe-expert-parallel-comm
        """),
}


def script_argv(name: str, tmp, ds_config=None) -> list[str]:
    """The argv of script ``name`` with its paths under ``tmp`` (and the DeepSpeed JSON at ``ds_config``), split
    on whitespace as the scripts' unquoted expansions split it (so ``'99,1,0'`` keeps its quotes)."""
    return SCRIPTS[name]["argv"].format(tmp=tmp, ds_config=ds_config).split()


def write_script_corpus(tmp, vocab_size: int, dtype) -> None:
    """The indexed dataset the scripts' ``{tmp}/data/corpus_text_document`` names: 64 documents of 300 ids below
    ``vocab_size``, stored as ``dtype``."""
    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    (tmp / "data").mkdir()
    with MMapIndexedDatasetBuilder(str(tmp / "data" / "corpus_text_document"), dtype=dtype) as builder:
        for doc in range(64):
            builder.add_item((np.arange(300) * (doc + 1)) % vocab_size)
            builder.end_document()
        builder.finalize()

"""Named hardware and model sizes the planner knows, with where each number comes from.

GPU figures are vendor datasheet values (dense bf16 and FP8 tensor-core peaks, HBM capacity and bandwidth).
Achievable NCCL bandwidths are "bus bandwidth" as nccl-tests reports it for large messages; they
are typical published figures, not measured here (no GPU on the build machine): override them with
``--intra-node-gbps`` / ``--inter-node-gbps`` when you have nccl-tests numbers for your cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config.hardware import FP8_MIN_CAPABILITY, PEAK_BF16_TFLOPS, PEAK_FP8_TFLOPS
from megatron.config.mla import MLAConfig
from megatron.config.model import ModelConfig, megatron_flops, mlp_flops_width, swiglu_default_ffn_size
from megatron.planner.fp8 import FP8Shape, fp8_shape_of
from megatron.planner.moe import MoEShape, mlp_params, moe_layer_params

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_bf16_tflops: float      # dense bf16 tensor-core peak (datasheet; sparsity not counted)
    memory_bytes: int            # what torch sees as total device memory
    hbm_gbps: float              # HBM bandwidth, GB/s (datasheet)
    nvlink_busbw_gbps: float     # achievable NCCL all-reduce bus bandwidth inside one 8-GPU node, GB/s
    peak_fp8_tflops: Optional[float] = None  # dense FP8 tensor-core peak (datasheet); None: no FP8 tensor cores
    compute_capability: tuple[int, int] = (8, 0)  # CUDA capability (torch.cuda.get_device_capability())

    @property
    def has_fp8(self) -> bool:
        """Whether torch._scaled_mm runs FP8 GEMMs here (capability 8.9+, megatron.config.hardware)."""
        return self.peak_fp8_tflops is not None and self.compute_capability >= FP8_MIN_CAPABILITY


GPUS = {
    # A100 SXM: 312 TFLOPs bf16, no FP8 tensor cores (capability 8.0); NVLink3 600 GB/s bidirectional;
    # nccl-tests all-reduce busbw ~230 GB/s on DGX A100.
    "A100-40GB": GPUSpec("A100-40GB", PEAK_BF16_TFLOPS["A100"], 40 * GiB, 1555.0, 230.0),
    "A100-80GB": GPUSpec("A100-80GB", PEAK_BF16_TFLOPS["A100"], 80 * GiB, 2039.0, 230.0),
    # H100 SXM: 989 TFLOPs bf16 dense; NVLink4 900 GB/s bidirectional; all-reduce busbw ~370 GB/s (NVLS off).
    # FP8 dense 1979 TFLOPs (twice bf16), capability 9.0.
    "H100-80GB": GPUSpec("H100-80GB", PEAK_BF16_TFLOPS["H100"], 80 * GiB, 3350.0, 370.0, PEAK_FP8_TFLOPS["H100"],
                         (9, 0)),
    # H200 SXM: H100's compute and NVLink with 141 GB (torch reports ~139.8 GiB) of HBM3e at 4.8 TB/s.
    "H200-141GB": GPUSpec("H200-141GB", PEAK_BF16_TFLOPS["H200"], int(139.8 * GiB), 4800.0, 370.0,
                          PEAK_FP8_TFLOPS["H200"], (9, 0)),
}


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """How the nodes are wired: GPUs per node and the achievable per-GPU inter-node bandwidth when
    every GPU of the node communicates at once (the usual case: all DP / PP groups run together)."""

    name: str
    gpus_per_node: int
    inter_node_gbps: float       # achievable per-GPU bus bandwidth across nodes, GB/s
    p2p_latency_us: float = 10.0     # one point-to-point message (inter-node), launch + wire latency
    collective_latency_us: float = 15.0  # fixed cost of one NCCL collective call


CLUSTERS = {
    # DGX A100 SuperPOD (Selene, Megatron-LM's 2021 runs): one 200 Gb/s HDR InfiniBand NIC per GPU
    # = 25 GB/s line rate, ~20 GB/s achieved.
    "dgx-a100": ClusterSpec("dgx-a100", 8, 20.0),
    # Jean Zay A100-80GB partition (BLOOM-176B): 8 GPUs per node and 4 x 100 Gb/s Omni-Path per node
    # = 50 GB/s per node, 6.25 GB/s per GPU line rate; ~5 GB/s achieved per GPU when all 8 talk.
    "jean-zay-a100": ClusterSpec("jean-zay-a100", 8, 5.0),
    # DGX H100 / H200: one 400 Gb/s NDR NIC per GPU = 50 GB/s line rate, ~40 GB/s achieved.
    "dgx-h100": ClusterSpec("dgx-h100", 8, 40.0),
}
DEFAULT_CLUSTER = {"A100-40GB": "dgx-a100", "A100-80GB": "dgx-a100", "H100-80GB": "dgx-h100",
                   "H200-141GB": "dgx-h100"}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes that set memory and FLOPs of a pre-norm decoder: GPT / BLOOM by default (LayerNorm,
    GeLU MLP of 4h, biases, one key / value head per query head), Llama-style with the fields below."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int                      # padded rows of the word embedding
    ffn_hidden_size: Optional[int] = None
    embed_layernorm: bool = True         # BLOOM's LayerNorm after the word embedding
    learned_positions: int = 0           # rows of a learned position embedding (0: ALiBi / rotary)
    tied_embeddings: bool = True         # output head = word embedding (a second copy on the last stage when PP > 1)
    num_key_value_heads: Optional[int] = None  # grouped-query attention; None: one per query head
    kv_channels: Optional[int] = None    # --kv-channels, each head's width; None: hidden / heads
    qk_layernorm: bool = False           # a norm of each query / key head (Qwen3): two head-wide weights per layer
    swiglu: bool = False                 # gated MLP: three f x h matrices instead of two
    add_bias_linear: bool = True         # biases in every linear layer
    add_qkv_bias: bool = False           # a QKV bias even without add_bias_linear (Qwen2)
    normalization: str = "layernorm"     # layernorm (weight + bias) | rmsnorm (weight)
    moe: Optional[MoEShape] = None       # routed experts in the layers its pattern marks (None: dense)
    fp8: Optional[FP8Shape] = None       # FP8 GEMMs in the layers its pattern marks (None: none; megatron.planner.fp8)
    mtp_num_layers: int = 0              # multi-token-prediction depths on the last stage (each: a layer of the last
                                         # layer's kind, its projection 2h x h and 3 norms; the word embedding too)
    mla_head_dims: Optional[tuple[int, int, int]] = None  # MLA's (dn, dr, dv) per head: what mla_up_proj recomputes
    mla: Optional[MLAConfig] = None      # multi-head latent attention's sizes (megatron.config.mla): its projections
                                         # replace QKV and the output projection (no biases, as the model builds it)

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return swiglu_default_ffn_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Each attention head's width: kv_channels, else hidden / heads."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def kv_hidden(self) -> int:
        """Width of the keys (and of the values): key / value heads x head dim."""
        heads = self.num_key_value_heads or self.num_attention_heads
        return heads * self.head_dim

    @property
    def q_hidden(self) -> int:
        """Width of the queries and of the attention context (the output projection's input): heads x head dim,
        the hidden size unless kv_channels says otherwise."""
        return self.num_attention_heads * self.head_dim

    @property
    def norm_params(self) -> int:
        return 2 * self.hidden_size if self.normalization == "layernorm" else self.hidden_size

    @property
    def attention_gemm_width(self) -> float:
        """The attention's projection weights over h: what one token's attention GEMMs cost, 2 h x this FLOPs
        forward (QKV and the output projection, 2 q + 2 kv; MLA's projections, ``MLAConfig.matmul_weights``)."""
        if self.mla is not None:
            return self.mla.matmul_weights(self.hidden_size, self.num_attention_heads) / self.hidden_size
        return 2 * self.q_hidden + 2 * self.kv_hidden

    @property
    def attention_score_width(self) -> float:
        """q in the core attention's 4 s q FLOPs per token (scores and context): the query width, or MLA's
        np (dn + dr + dv) / 2 (``MLAConfig.score_width``)."""
        if self.mla is not None:
            return self.mla.score_width(self.num_attention_heads)
        return self.q_hidden

    @property
    def mla_kept_widths(self) -> tuple[int, int]:
        """MLA's tensors kept for backward, per token in elements: (the heads' part, split by TP: the query and
        key np (dn + dr) each, the key / value up-projection's output np (dn + dv) (the value the core keeps is a
        view of it) and the context np dv; the latents' part, whole on every TP rank (split with SP): the
        down-projections' outputs dq + dc + dr, and with --qk-layernorm each latent twice more, the norm's output
        and the up-projection's flattened input, 2 (dq + dc)). Measured on the module
        (tests/planner/test_mla_shapes.py)."""
        mla, heads = self.mla, self.num_attention_heads
        dq = mla.q_lora_rank or 0
        latents = dq + mla.kv_lora_rank + mla.qk_pos_emb_head_dim + (2 * (dq + mla.kv_lora_rank)
                                                                      if self.qk_layernorm else 0)
        return heads * (2 * mla.q_head_dim + mla.qk_head_dim + 2 * mla.v_head_dim), latents

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one transformer layer held by one TP rank (column/row-parallel split, norms
        and row-parallel biases replicated)."""
        h, f, qkv = self.hidden_size, self.ffn, self.q_hidden + 2 * self.kv_hidden
        fc1 = 2 * f if self.swiglu else f
        if self.mla is not None:  # MLA's projections (no biases) and latent norms, then the MLP as below
            norm = self.norm_params // self.hidden_size if self.qk_layernorm else 0
            split = self.mla.split_weights(h, self.num_attention_heads) + fc1 * h + f * h + \
                (fc1 if self.add_bias_linear else 0)
            return split // tp + 2 * self.norm_params + (h if self.add_bias_linear else 0) + \
                self.mla.replicated_weights(h, norm)
        split = qkv * h + h * self.q_hidden + fc1 * h + f * h  # qkv, dense, h -> ffn (gate and up), ffn -> h
        if self.add_bias_linear or self.add_qkv_bias:
            split += qkv
        if self.add_bias_linear:
            split += fc1
        replicated = 2 * self.norm_params + (2 * h if self.add_bias_linear else 0)  # norms, dense and ffn -> h biases
        if self.qk_layernorm:
            # the query and key head norms, shared by every head: a weight (and LayerNorm's bias) each
            replicated += 2 * self.norm_params // self.hidden_size * self.head_dim
        return split // tp + replicated

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` routes; an MTP depth's layer (``num_layers`` + depth) has the last layer's kind."""
        return self.moe is not None and self.moe.layer_pattern[min(layer, self.num_layers - 1)]

    def mtp_params(self, tp: int = 1, ep: int = 1, etp: int = 0) -> int:
        """Parameters of the MTP depths on one (TP, EP) rank: each its layer, its projection [h / tp, 2h] and its
        enorm, hnorm and final norm (the shared embedding and head are counted where they are held)."""
        per_depth = 2 * self.hidden_size * self.hidden_size // tp + 3 * self.norm_params
        return sum(sum(self.layer_params_split(self.num_layers + k, tp, ep, etp)) + per_depth
                   for k in range(self.mtp_num_layers))

    def layer_params_split(self, layer: int, tp: int = 1, ep: int = 1, etp: int = 0) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of layer ``layer`` on one (TP, EP) rank, the experts split over
        ``etp`` ranks (0: tp; ``megatron.planner.moe``); a dense layer has no expert part."""
        if not self.is_moe_layer(layer):
            return self.layer_params(tp), 0
        dense_mlp = mlp_params(self.hidden_size, self.ffn, self.swiglu, self.add_bias_linear, tp)
        return moe_layer_params(self.layer_params(tp), dense_mlp, self.moe, self.hidden_size, self.swiglu,
                                self.add_bias_linear, tp, ep, etp)

    def total_params(self) -> int:
        h = self.hidden_size
        extra = self.norm_params if self.embed_layernorm else 0
        head = 0 if self.tied_embeddings else self.vocab_size * h
        layers = sum(sum(self.layer_params_split(i)) for i in range(self.num_layers)) + self.mtp_params()
        return self.vocab_size * h + self.learned_positions * h + extra + layers + self.norm_params + head

    @property
    def mlp_flops_width(self) -> float:
        """The dense MLP width with the same matmul FLOPs per token, averaged over the layers: an MoE layer
        counts k x the expert width + the shared expert's + the router's E / m (``ModelConfig.mlp_flops_width``)."""
        moe = self.moe
        if moe is None:
            return self.ffn
        num_moe = moe.num_moe_layers + self.mtp_num_layers * self.is_moe_layer(self.num_layers - 1)
        return mlp_flops_width(self.num_layers + self.mtp_num_layers, self.ffn, self.swiglu, num_moe, moe.topk,
                               moe.expert_ffn, moe.shared_expert_ffn, moe.num_experts)

    def flops_per_iteration(self, seq_length: int, global_batch_size: int, recompute: bool) -> float:
        """``megatron_flops`` of this shape."""
        return megatron_flops(self.num_layers + self.mtp_num_layers, self.hidden_size, self.vocab_size, seq_length,
                              global_batch_size, recompute, ffn_hidden_size=self.mlp_flops_width,
                              kv_hidden_size=self.kv_hidden, swiglu=self.swiglu, query_hidden_size=self.q_hidden,
                              mtp_num_layers=self.mtp_num_layers, mla=self.mla,
                              num_attention_heads=self.num_attention_heads)


def model_shape_of(config: ModelConfig, vocab_size: Optional[int] = None) -> ModelShape:
    """The ModelShape of a ModelConfig (``vocab_size``: the padded rows, default ``config.padded_vocab_size``)."""
    return ModelShape(config.num_layers, config.hidden_size, config.num_attention_heads,
                      vocab_size if vocab_size is not None else config.padded_vocab_size, config.ffn_size,
                      embed_layernorm=config.embed_layernorm,
                      learned_positions=config.max_positions if config.position_embedding_type == "absolute" else 0,
                      tied_embeddings=config.tied_embeddings, num_key_value_heads=config.num_kv_heads,
                      # MLA's head sizes are its own (``mla``): --kv-channels does not apply; --qk-layernorm is
                      # its latent norms there
                      kv_channels=config.kv_channels if config.mla is None else None,
                      qk_layernorm=config.qk_layernorm,
                      swiglu=config.swiglu, add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
                      normalization=config.normalization, moe=_moe_shape_of(config),
                      fp8=fp8_shape_of(config.fp8, config.num_layers), mtp_num_layers=config.mtp_num_layers,
                      mla_head_dims=None if config.mla is None else (config.mla.qk_head_dim,
                                                                     config.mla.qk_pos_emb_head_dim,
                                                                     config.mla.v_head_dim),
                      mla=config.mla)


def _moe_shape_of(config: ModelConfig) -> Optional[MoEShape]:
    moe = config.moe
    if moe is None:
        return None
    return MoEShape(moe.num_experts, moe.router_topk, config.expert_ffn_size, moe.layer_pattern,
                    moe.shared_expert_intermediate_size or 0, moe.expert_capacity_factor)


def _bloom(layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=250880)


# BigScience's training names (tr11 series) and the released checkpoint each became. All use the
# 250,880-row padded vocabulary, ALiBi, an embedding LayerNorm and seq 2048. "7B1" is the released
# name of the model trained as "6B3": the same architecture, listed under both names.
BLOOM_SIZES = {
    "350M": _bloom(24, 1024, 16),    # tr11e, released as bloom-560m
    "760M": _bloom(24, 1536, 16),    # tr11d, bloom-1b1
    "1B3": _bloom(24, 2048, 16),     # tr11b, bloom-1b7
    "2B5": _bloom(30, 2560, 32),     # tr11c, bloom-3b
    "6B3": _bloom(30, 4096, 32),     # tr11f, bloom-7b1
    "7B1": _bloom(30, 4096, 32),
    "176B": _bloom(70, 14336, 112),  # tr11-176B-ml, bloom
}


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> ModelShape:
    return ModelShape(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                      ffn_hidden_size=ffn, embed_layernorm=False, tied_embeddings=False, num_key_value_heads=kv_heads,
                      swiglu=True, add_bias_linear=False, normalization="rmsnorm")


# Meta's Llama shapes (their params.json / transformers configs): RMSNorm, SwiGLU, rotary, no biases,
# untied head. The vocabularies are multiples of 128, so Megatron's padding leaves them as they are.
LLAMA_SIZES = {
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008, 32000),
    "llama-2-70b": _llama(80, 8192, 64, 8, 28672, 32000),
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256),
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256),
}


def _moe(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, moe: MoEShape) -> ModelShape:
    return dataclasses.replace(_llama(layers, hidden, heads, kv_heads, ffn, vocab), moe=moe)


# Mixture-of-experts shapes (their transformers configs). DeepSeek-V3's attention is multi-head latent attention
# (MLA: a query latent of 1536, a key / value latent of 512, 128 heads of 128 + 64 rotary dims, values of 128, the
# latents normed): 187.1M attention parameters per layer. Its first 3 layers are dense (width 18432), the other 58
# hold 256 routed experts (top-8) of width 2048 and one shared expert of the same width; vocabulary 129280,
# untied: 671.03B parameters (DeepSeek-V3's 671B; without its MTP module).
MOE_SIZES = {
    "mixtral-8x7b": _moe(32, 4096, 32, 8, 14336, 32000, MoEShape(8, 2, 14336, (True,) * 32)),
    "deepseek-v3": dataclasses.replace(
        _moe(61, 7168, 128, 128, 18432, 129280,
             MoEShape(256, 8, 2048, (False,) * 3 + (True,) * 58, shared_expert_ffn=2048)),
        qk_layernorm=True, mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                                         qk_pos_emb_head_dim=64, v_head_dim=128)),
}
MODEL_SIZES = {**BLOOM_SIZES, **LLAMA_SIZES, **MOE_SIZES}

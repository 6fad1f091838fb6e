"""Named hardware and model sizes the planner knows, with where each number comes from.

GPU figures are vendor datasheet values (dense bf16 tensor-core peak, HBM capacity and bandwidth).
Achievable NCCL bandwidths are "bus bandwidth" as nccl-tests reports it for large messages; they
are typical published figures, not measured here (no GPU on the build machine): override them with
``--intra-node-gbps`` / ``--inter-node-gbps`` when you have nccl-tests numbers for your cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_bf16_tflops: float      # dense bf16 tensor-core peak (datasheet; sparsity not counted)
    memory_bytes: int            # what torch sees as total device memory
    hbm_gbps: float              # HBM bandwidth, GB/s (datasheet)
    nvlink_busbw_gbps: float     # achievable NCCL all-reduce bus bandwidth inside one 8-GPU node, GB/s


GPUS = {
    # A100 SXM: 312 TFLOPs bf16; NVLink3 600 GB/s bidirectional; nccl-tests all-reduce busbw ~230 GB/s on DGX A100.
    "A100-40GB": GPUSpec("A100-40GB", 312.0, 40 * GiB, 1555.0, 230.0),
    "A100-80GB": GPUSpec("A100-80GB", 312.0, 80 * GiB, 2039.0, 230.0),
    # H100 SXM: 989 TFLOPs bf16 dense; NVLink4 900 GB/s bidirectional; all-reduce busbw ~370 GB/s (NVLS off).
    "H100-80GB": GPUSpec("H100-80GB", 989.0, 80 * GiB, 3350.0, 370.0),
    # H200 SXM: H100's compute and NVLink with 141 GB (torch reports ~139.8 GiB) of HBM3e at 4.8 TB/s.
    "H200-141GB": GPUSpec("H200-141GB", 989.0, int(139.8 * GiB), 4800.0, 370.0),
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
    """The sizes that set memory and FLOPs of a GPT / BLOOM decoder (pre-LN, ffn = 4h by default)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int                      # padded rows of the word embedding
    ffn_hidden_size: Optional[int] = None
    embed_layernorm: bool = True         # BLOOM's LayerNorm after the word embedding
    learned_positions: int = 0           # rows of a learned position embedding (0: ALiBi / rotary)
    tied_embeddings: bool = True         # output head = word embedding (a second copy on the last stage when PP > 1)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one transformer layer held by one TP rank (column/row-parallel split, norms
        and row-parallel biases replicated)."""
        h, f = self.hidden_size, self.ffn
        split = (3 * h * h + 3 * h) + h * h + (h * f + f) + f * h   # qkv w+b, dense w, h->4h w+b, 4h->h w
        replicated = 4 * h + h + h                                    # two LayerNorms, dense and 4h->h biases
        return split // tp + replicated

    def total_params(self) -> int:
        h = self.hidden_size
        extra = 2 * h if self.embed_layernorm else 0
        return self.vocab_size * h + self.learned_positions * h + extra + self.num_layers * self.layer_params() + 2 * h


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

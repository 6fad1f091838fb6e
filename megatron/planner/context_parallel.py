"""Context parallelism (``--context-parallel-size c``, ring attention) in the planner: what a rank keeps, what
the ring sends, and how much of it the block computation hides.

Memory. Each of the c ranks of a CP group holds s/c tokens of every activation (chunks i and 2c-1-i of 2c), so a
layer keeps Korthikanti's terms for s/c tokens (``megatron.planner.memory.layer_activation_bytes``) without the
[np, s, s] scores: the ring kernel (``megatron.model.ring_attention``) computes one [b, np, s/2c, s/2c] block at a
time. What the kernel saves beyond a fused kernel's set (``RingAttention.save_for_backward``): its output beside
the dense projection's input (a permuted copy, so a second context-sized tensor: w bytes per hp / t) and the
fp32 log-sum-exp [b, np/t, s/c] (4 np/t bytes per token):

    ring_saved_bytes = s/c * b * (w * hp / t + 4 * np / t)

While one layer runs backward, the ring's buffers are alive besides (``ring_buffer_bytes``): the key / value block
in use and the one arriving, in the activations' dtype, and the dK / dV block travelling with them and the one
arriving, in fp32: 2 x 2 blocks of w bytes + 2 x 2 blocks of 4 bytes, one block = b * ng/t * s/c * hn elements
(the forward's buffers, 2 x 2 blocks of w, are fewer).

Communication per layer and micro-batch on one rank (``ring_bytes``; the CP helper measured exactly this count,
tests/model/test_ring_attention.py and tests/planner/test_context_parallel_plan.py):

    forward    (c - 1) x (K + V) blocks in w
    backward   (c - 1) x (K + V) blocks in w  +  c x (dK + dV) blocks in fp32
    recompute  full recomputation replays the forward: (c - 1) x (K + V) more

Every message goes to the next rank of the CP group: NVLink while TP x CP fits a node (CP sits next to TP in the
rank order), else the GPU's NIC. Overlap (``ring_exposed_s``): the kernel starts sending the next K / V block
before it computes on the current one, so each of those hops costs only what its transfer takes beyond one
block's attention (s/c queries against s/c keys: 4 b (s/c)^2 h / t FLOPs forward, twice that backward, at the
planner's attention rate; causal skipping is not credited, as the planner's attention FLOPs are not either). The
dK / dV hop is started after the block's backward and waited for at once: it is exposed whole.

Nothing here imports torch.
"""

from __future__ import annotations

from megatron.planner.candidate import Layout
from megatron.planner.specs import ClusterSpec, GPUSpec, ModelShape

__all__ = ["kv_block_elements", "ring_bytes", "ring_buffer_bytes", "ring_exposed_s", "ring_saved_bytes",
           "step_ring_bytes"]

GRAD_BYTES = 4  # dK / dV travel in fp32 (the kernel accumulates them there)


def kv_block_elements(model: ModelShape, layout: Layout, seq_length: int) -> float:
    """One rank's key (or value) block of one micro-batch: b x ng/t x s/c x hn elements."""
    return layout.micro_batch_size * model.kv_hidden / layout.tp * seq_length / layout.cp


def ring_saved_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int) -> float:
    """What the ring kernel keeps for backward beyond a fused kernel's set (module docstring), one layer."""
    tokens = seq_length / layout.cp * layout.micro_batch_size
    heads = model.num_attention_heads / layout.tp
    return tokens * (bytes_per_element * model.q_hidden / layout.tp + 4 * heads)


def ring_buffer_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int) -> float:
    """The ring's buffers while one layer runs backward: 2 K/V pairs in w, 2 dK/dV pairs in fp32."""
    if layout.cp == 1:
        return 0.0
    return 4 * kv_block_elements(model, layout, seq_length) * (bytes_per_element + GRAD_BYTES)


def ring_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int) -> dict:
    """Bytes one rank sends around the ring for ONE layer and micro-batch: ``forward``, ``backward``,
    ``recomputed_forward`` (0 without full recomputation), their ``total``, and the ``sends`` (messages)."""
    c = layout.cp
    if c == 1:
        return {"forward": 0.0, "backward": 0.0, "recomputed_forward": 0.0, "total": 0.0, "sends": 0}
    pair = 2 * kv_block_elements(model, layout, seq_length)  # K + V
    forward = (c - 1) * pair * bytes_per_element
    backward = forward + c * pair * GRAD_BYTES
    recomputed = forward if layout.recompute else 0.0
    forwards = 2 if layout.recompute else 1
    return {"forward": forward, "backward": backward, "recomputed_forward": recomputed,
            "total": forward + backward + recomputed, "sends": 2 * ((forwards + 1) * (c - 1) + c)}


def step_ring_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int, num_layers: int,
                    num_micro_batches: int) -> dict:
    """``ring_bytes`` for a whole step of one rank: ``num_layers`` layers (its stage's), every micro-batch."""
    one = ring_bytes(model, layout, seq_length, bytes_per_element)
    return {key: value * num_layers * num_micro_batches for key, value in one.items()}


def ring_bandwidth_gbps(layout: Layout, gpu: GPUSpec, cluster: ClusterSpec) -> float:
    """NVLink while the TP x CP consecutive ranks fit a node, else the GPU's share of the inter-node fabric."""
    return gpu.nvlink_busbw_gbps if layout.tp * layout.cp <= cluster.gpus_per_node else cluster.inter_node_gbps


def ring_exposed_s(model: ModelShape, layout: Layout, gpu: GPUSpec, cluster: ClusterSpec, seq_length: int,
                   n_layers: int, attention_flops_per_s: float, bytes_per_element: int = 2) -> float:
    """The ring's time of one micro-batch that the block computation does not hide (module docstring)."""
    c = layout.cp
    if c == 1:
        return 0.0
    bw = ring_bandwidth_gbps(layout, gpu, cluster) * 1e9
    latency = cluster.p2p_latency_us * 1e-6
    pair = 2 * kv_block_elements(model, layout, seq_length)
    kv_hop = pair * bytes_per_element / bw + latency
    grad_hop = pair * GRAD_BYTES / bw + latency
    block_forward = 4 * layout.micro_batch_size * (seq_length / c) ** 2 * model.q_hidden / layout.tp \
        / attention_flops_per_s
    forwards = 2 if layout.recompute else 1
    exposed_forward = (c - 1) * max(0.0, kv_hop - block_forward)
    exposed_backward = (c - 1) * max(0.0, kv_hop - 2 * block_forward) + c * grad_hop
    return n_layers * (forwards * exposed_forward + exposed_backward)

"""Step time of one layout from a compute + communication model, and the TFLOPs it implies.

Per micro-batch, on the slowest pipeline stage (everything below is per GPU):

  matmul      FLOPs / (peak * GEMM_EFFICIENCY * rows / (rows + GEMM_HALF_ROWS)), rows = b*s.
              Per layer forward 2*b*s*h*(2h + 2kv + m*f) (dense: qkv, output, m = 2 MLP matrices, 3
              with SwiGLU; 24*b*s*h^2 for GPT) at that rate plus 4*b*s^2*h (attention
              scores and context) at ATTENTION_EFFICIENCY of peak; backward = 2 x forward;
              recomputation adds one forward. The last stage adds the logits, 2*b*s*h*V x 3.
              All divided by t.
  elementwise the activation bytes of Korthikanti's formula moved ELEMENTWISE_PASSES times
              through HBM (layer norms, GeLU, bias, dropout, softmax; +1 pass with recompute).
  TP          all-reduce of s*b*h bf16 values: 2 in forward, 2 in backward per layer (+1 with
              recompute: torch's non-reentrant checkpoint stops replaying before the MLP's), and
              1 + 1 for the embedding and the output head:
              2(t-1)/t * bytes / busbw + latency, busbw = NVLink inside a node.
  SP          (sequence parallelism) each TP all-reduce becomes a reduce-scatter + an all-gather of
              the same bytes (an all-reduce is both: no change in volume, twice the calls), and backward
              gathers the QKV and MLP inputs again for the weight gradients (2 all-gathers per layer).
              Once per step the norms' (and row-parallel biases') gradients, partial sums over a rank's
              s/t tokens, are all-reduced over TP in fp32.
  Ulysses     with degree u every layer runs on s/u tokens (GEMM rows b*s/u; attention over the full s
              for a/(t*u) heads): compute / u. Around the core attention 4 all-to-alls in forward (q, k,
              v, the context: s/u*b*h/t bf16 values each, k and v kv_hidden wide), 4 in backward, 4 more in
              a recomputed forward, each moving (u-1)/u of its tensor: NVLink while t*u fits a node.
  CP          (context parallelism, ring attention) every layer on s/c tokens: GEMM rows b*s/c, attention
              s/c queries against s keys (compute / c); the ring's K / V (and dK / dV) sends, less what the
              block computation hides (``megatron.planner.context_parallel.ring_exposed_s``): ``cp_comm``.
  PP          one activation forward and one gradient backward of s*b*h bf16 (fp32: 4 bytes) per micro-batch; with
              TP > 1 DeepSpeed sends 1/t of it and all-gathers it over the TP group (3 per slot).
  MoE         (``ModelShape.moe``) an MoE layer's MLP FLOPs are k experts' + the shared expert's + the router's;
              its token all-to-alls (``megatron.planner.moe.layer_bytes`` for the s / (u x cp) tokens a rank
              routes, the cross-rank part) go over NVLink
              while TP x EP fits a node, else over the GPU's NIC; the experts' gradients are all-reduced (and
              under ZeRO-1 their weights all-gathered) over the DP / EP ranks that hold them. The experts'
              GEMMs are counted at the dense GEMMs' rate (T k / E rows each: optimistic for small batches).
  FP8         (``ModelShape.fp8``, ``megatron.planner.fp8``) the FP8 layers' linear GEMMs (QKV, attention output,
              MLP, routed experts; not the core attention, the logits, the router, nor the layers --first-last-layers-bf16
              keeps) at the GPU's FP8 peak x GEMM_EFFICIENCY x rows / (rows + GEMM_HALF_ROWS), the weight gradients
              at the bf16 rate under --no-fp8-wgrad; ``fp8_quantize``: the quantizers' HBM passes (and the block
              recipes' per-K-block sums). MFU stays model FLOPs / the bf16 peak (Megatron's convention).
  grad accum  BF16_Optimizer adds the bf16 .grad into the fp32 buffer after every micro-batch
              (read 2N + read/write 8N bytes) and zeroes the bf16 grads (2N).

Step = (m + p - 1) * slot + DP + tied embedding + optimizer, where slot is the slowest stage's
micro-batch time (1F1B: m micro-batches plus p-1 slots of fill and drain; bubble (p-1)/m). Other schedules
(``megatron.planner.schedule_costs``): ZB-H1 idles (p - 1)(F + B - W), W the weight-gradient GEMMs (one forward's
weight GEMMs); interleaved with v chunks per rank (p - 1) / v slots, and v times the p2p sends per slot.
  DP          over d = DP x Ulysses ranks (all of them hold the same weights).
              BF16_Optimizer all-reduces the fp32 gradient buffer cast to bf16, DeepSpeed's default
              communication_data_type (2N bytes: 2(d-1)/d * 2N / bw),
              then all-gathers the updated bf16 weights from their DP owners ((d-1)/d * 2N / bw).
              DeepSpeed's pipeline engine does both after the last micro-batch: no overlap.
              fp16 (ZeRO 0): the fp16 gradients all-reduced as they are (2N bytes), no all-gather.
  tied emb.   fp32 gradient of the word embedding all-reduced between the first and last stage.
  optimizer   Adam over N/d fp32 values: ~32 bytes each through HBM, plus the grad-norm read.

Constants are named below; which were chosen how is in docs/performance.md.
"""

from __future__ import annotations

import dataclasses

from megatron.planner.candidate import Layout, stage_layer_counts
from megatron.planner.context_parallel import ring_exposed_s
from megatron.planner.fp8 import fp8_forward_flops, quantize_bytes, stage_fp8_layers
from megatron.planner.memory import layer_activation_bytes, stage_expert_param_counts, stage_param_counts
from megatron.planner.moe import layer_bytes
from megatron.planner.schedule_costs import bubble_slots
from megatron.planner.specs import ClusterSpec, GPUSpec, ModelShape

GEMM_EFFICIENCY = 0.75       # large bf16 GEMMs reach ~75% of the dense peak (cuBLAS, A100 and H100)
GEMM_HALF_ROWS = 128         # rows (b*s) at which a GEMM runs at half of that: small micro-batches lose
ATTENTION_EFFICIENCY = 0.40  # batched score/context matmuls with the ALiBi bias and softmax around them
ELEMENTWISE_PASSES = 3.0     # HBM passes over the activation bytes per forward + backward


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    step_s: float
    slot_s: float                 # slowest stage, one micro-batch forward + backward (+ recompute)
    bubble_s: float
    components_s: dict            # where a step's time goes (summed over the step, slowest stage)
    model_flops: float            # per step, without recomputation (Megatron formula, c = 3)
    hardware_flops: float         # per step, counting the recomputed forward (c = 4 with recompute)
    num_gpus: int
    tokens_per_step: int
    peak_tflops: float

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / self.num_gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_s / self.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu / self.peak_tflops

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def _allreduce_s(num_bytes: float, ranks: int, busbw_gbps: float, latency_us: float) -> float:
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * num_bytes / (busbw_gbps * 1e9) + latency_us * 1e-6


def _allgather_s(num_bytes: float, ranks: int, busbw_gbps: float, latency_us: float) -> float:
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * num_bytes / (busbw_gbps * 1e9) + latency_us * 1e-6


def _alltoall_s(num_bytes: float, ranks: int, busbw_gbps: float, latency_us: float) -> float:
    """Each rank keeps 1/ranks of its tensor and sends the rest: (ranks-1)/ranks of it crosses links."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * num_bytes / (busbw_gbps * 1e9) + latency_us * 1e-6


def _bandwidths(layout: Layout, gpu: GPUSpec, cluster: ClusterSpec) -> tuple[float, float, float]:
    """(TP, DP, PP) bus bandwidths in GB/s: NVLink while the group fits in a node (TP innermost,
    then the Ulysses group, then DP, then PP, in DeepSpeed's rank order), else the inter-node
    bandwidth its ring gets. DP here is the weight replicas' group, DP x Ulysses."""
    node, inter, nv = cluster.gpus_per_node, cluster.inter_node_gbps, gpu.nvlink_busbw_gbps
    replicas = layout.weight_replicas
    tp_bw = nv if layout.tp <= node else inter
    # A ring over nodes crosses each node once per group: the node's NICs are shared by the
    # node // (members on the node) groups, so a group gets inter * members-per-node.
    dp_members_per_node = max(1, min(replicas, node // layout.tp))
    dp_bw = nv if layout.tp * replicas <= node else inter * dp_members_per_node
    pp_bw = nv if layout.world_size <= node else inter
    return tp_bw, dp_bw, pp_bw


def _tp_comm_s(model: ModelShape, layout: Layout, cluster: ClusterSpec, seq_length: int, n_layers: int,
               first: bool, last: bool, tp_bw: float) -> float:
    """TP collectives of one micro-batch: all-reduces, or with SP reduce-scatter + all-gather pairs."""
    t, latency = layout.tp, cluster.collective_latency_us
    nbytes = 2 * seq_length / layout.token_split * layout.micro_batch_size * model.hidden_size
    calls = n_layers * (5 if layout.recompute else 4) + (1 if first else 0) + (1 if last else 0)  # see comm_count
    if not layout.sequence_parallel:
        return calls * _allreduce_s(nbytes, t, tp_bw, latency)
    regathers = 2 * n_layers  # the QKV and MLP inputs, gathered again for the weight gradients
    return (2 * calls + regathers) * _allgather_s(nbytes, t, tp_bw, latency)


def _ulysses_comm_s(model: ModelShape, layout: Layout, gpu: GPUSpec, cluster: ClusterSpec, seq_length: int,
                    n_layers: int) -> float:
    """The all-to-alls around the core attention of one micro-batch (forward, backward, recomputation)."""
    u, t = layout.ulysses, layout.tp
    if u == 1:
        return 0.0
    bw = gpu.nvlink_busbw_gbps if t * u <= cluster.gpus_per_node else cluster.inter_node_gbps
    tokens = seq_length / u * layout.micro_batch_size
    widths = (model.q_hidden, model.kv_hidden, model.kv_hidden, model.q_hidden)  # q, k, v, context
    one_pass = sum(_alltoall_s(2 * tokens * width / t, u, bw, cluster.collective_latency_us) for width in widths)
    return n_layers * one_pass * (3 if layout.recompute else 2)


def _moe_comm_s(model: ModelShape, layout: Layout, gpu: GPUSpec, cluster: ClusterSpec, seq_length: int,
                n_moe_layers: int) -> float:
    """The token all-to-alls of one micro-batch's MoE layers (``megatron.planner.moe.layer_bytes``: dispatch and
    combine, forward, backward, a recomputed forward): NVLink while the EP group (TP x EP consecutive ranks) fits
    a node, else each GPU's own NIC."""
    if layout.ep == 1 or not n_moe_layers:
        return 0.0
    bw = gpu.nvlink_busbw_gbps if layout.tp * layout.ep <= cluster.gpus_per_node else cluster.inter_node_gbps
    # each rank routes its own s / (u x cp) tokens of each sample, and under sequence parallelism each TP rank its
    # own share of them (megatron.config.moe.routes_tp_shards; else the TP ranks route the same tokens)
    one = layer_bytes(model.moe, seq_length // layout.sequence_split * layout.micro_batch_size, model.hidden_size, 2,
                      layout.ep, layout.recompute)
    return n_moe_layers * (one["cross_rank"] / (bw * 1e9) + one["calls"] * cluster.collective_latency_us * 1e-6)


def _mlp_width(model: ModelShape, n_layers: int, n_moe_layers: int) -> float:
    """The stage's average MLP width for the FLOPs (an MoE layer: k experts + the shared one + the router)."""
    if not n_moe_layers:
        return model.ffn
    moe = model.moe
    width = moe.topk * moe.expert_ffn + moe.shared_expert_ffn + moe.num_experts / (3 if model.swiglu else 2)
    return ((n_layers - n_moe_layers) * model.ffn + n_moe_layers * width) / n_layers


def _fp8_rate(gpu: GPUSpec, rows: float) -> float:
    """The FP8 GEMMs' FLOP/s: the GPU's FP8 peak at the bf16 GEMMs' efficiency (an assumption, not measured)."""
    if not gpu.has_fp8:
        raise ValueError(f"the {gpu.name} has no FP8 tensor cores (torch._scaled_mm needs CUDA capability 8.9+): an "
                         f"FP8 model (--fp8-format) cannot be planned on it; drop --fp8-format or use H100 / H200")
    return gpu.peak_fp8_tflops * 1e12 * GEMM_EFFICIENCY * rows / (rows + GEMM_HALF_ROWS)


def _weight_gemm_forward_s(model: ModelShape, layout: Layout, gpu: GPUSpec, seq_length: int, n_layers: int,
                           n_moe_layers: int, head: bool, fp8_layers: tuple[int, int] = (0, 0),
                           weight_grad: bool = False) -> float:
    """One forward's GEMMs with weights on a stage (qkv, dense, MLP; the logits when ``head``): also what a
    weight-gradient pass (ZB-H1's W) costs, dA = dY^T X being as many FLOPs as Y = X A^T. ``fp8_layers``: the
    (dense, MoE) layers among them whose linear GEMMs run FP8 (``megatron.planner.fp8``), at the FP8 rate; with
    ``weight_grad`` under --no-fp8-wgrad those run at the bf16 rate."""
    h, t = model.hidden_size, layout.tp
    rows = layout.micro_batch_size * seq_length / layout.token_split
    gemm_rate = gpu.peak_bf16_tflops * 1e12 * GEMM_EFFICIENCY * rows / (rows + GEMM_HALF_ROWS)
    mlp_matrices = 3 if model.swiglu else 2
    dense = 2 * rows * h * (model.attention_gemm_width + mlp_matrices * _mlp_width(model, n_layers, n_moe_layers))
    fp8 = fp8_forward_flops(model, rows, *fp8_layers) if any(fp8_layers) else 0
    out = (n_layers * dense - fp8) / t / gemm_rate if n_layers else 0.0
    if fp8:
        out += fp8 / t / (gemm_rate if weight_grad and not model.fp8.wgrad else _fp8_rate(gpu, rows))
    if head:
        out += 2 * rows * h * model.vocab_size / t / gemm_rate
    return out


def _stage_slot(model: ModelShape, layout: Layout, gpu: GPUSpec, cluster: ClusterSpec, seq_length: int,
                n_layers: int, n_params: int, first: bool, last: bool, tp_bw: float, n_moe_layers: int = 0,
                fp8_layers: tuple[int, int] = (0, 0)) -> dict:
    b, t, u = layout.micro_batch_size, layout.tp, layout.ulysses
    s = seq_length
    passes = 4 if layout.recompute else 3  # forward, backward (2x), recomputed forward
    attn_rate = gpu.peak_bf16_tflops * 1e12 * ATTENTION_EFFICIENCY
    # s/u (s/c) queries against s keys, or a/(tu) heads
    attn = 4 * b * s * s * model.attention_score_width * passes / (t * layout.token_split)
    # the weight GEMMs: one forward's worth per pass (the head's logits: forward, input and weight gradients)
    forward = _weight_gemm_forward_s(model, layout, gpu, seq_length, n_layers, n_moe_layers, False, fp8_layers)
    if any(fp8_layers) and not model.fp8.wgrad:  # --no-fp8-wgrad: the weight-gradient pass at the bf16 rate
        matmul = forward * (passes - 1) + _weight_gemm_forward_s(model, layout, gpu, seq_length, n_layers,
                                                                 n_moe_layers, False, fp8_layers, weight_grad=True)
    else:
        matmul = forward * passes
    matmul += n_layers * attn / attn_rate
    if last:
        matmul += 3 * _weight_gemm_forward_s(model, layout, gpu, seq_length, 0, 0, True)
    activations = (n_layers - n_moe_layers) * layer_activation_bytes(model, layout, seq_length)
    if n_moe_layers:
        activations += n_moe_layers * layer_activation_bytes(model, layout, seq_length, moe_layer=True)
    elementwise = activations * (ELEMENTWISE_PASSES + (1 if layout.recompute else 0)) / (gpu.hbm_gbps * 1e9)
    tp = _tp_comm_s(model, layout, cluster, seq_length, n_layers, first, last, tp_bw)
    accum = (12 * n_params if layout.precision == "bf16" else 0) / (gpu.hbm_gbps * 1e9)
    out = {"matmul": matmul, "elementwise": elementwise, "tp_comm": tp, "grad_accum": accum}
    if any(fp8_layers):  # the quantizers' HBM passes (and the block recipes' per-K-block sums): megatron.planner.fp8
        rows = b * s / layout.token_split
        out["fp8_quantize"] = quantize_bytes(model, rows, t, *fp8_layers, layout.recompute, ep=layout.ep) / (gpu.hbm_gbps * 1e9)
    if u > 1:
        out["ulysses_comm"] = _ulysses_comm_s(model, layout, gpu, cluster, seq_length, n_layers)
    if layout.cp > 1:
        w = 4 if layout.precision == "fp32" else 2
        out["cp_comm"] = ring_exposed_s(model, layout, gpu, cluster, seq_length, n_layers, attn_rate, w)
    if n_moe_layers and layout.ep > 1:
        out["moe_all_to_all"] = _moe_comm_s(model, layout, gpu, cluster, seq_length, n_moe_layers)
    return out


def _dp_comm_s(model: ModelShape, layout: Layout, gpu: GPUSpec, cluster: ClusterSpec, n: int, n_experts: int,
               m: int, dp_bw: float) -> float:
    """Data-parallel communication of one step: ZeRO-2 / 3's per micro-batch, or BF16_Optimizer's once (the routed
    experts' ``n_experts`` parameters over their DP / EP ranks)."""
    bytes_grad = 4 if layout.precision == "fp32" else 2  # bf16: cast to communication_data_type; fp16 grads as they are
    latency = cluster.collective_latency_us
    d = layout.weight_replicas
    if layout.zero_stage >= 2:
        # ZeRO-2: each micro-batch's gradients ALL-REDUCED whole (the pinned DeepSpeed's multi-rank bucket
        # all-reduce, measured: megatron.planner.comm_zero), the updated weights all-gathered once; ZeRO-3:
        # every micro-batch all-gathers the weights for forward and again for backward (stage3_max_reuse_distance
        # 0; DeepSpeed's default keeps what is reused within 1e9 elements) and reduce-scatters its gradients;
        # no overlap with compute is assumed (pessimistic)
        width = 2 if layout.precision == "bf16" else 4
        if layout.zero_stage == 2:
            scatter = m * _allreduce_s(bytes_grad * n, d, dp_bw, latency)
        else:
            scatter = m * _allgather_s(bytes_grad * n, d, dp_bw, latency)
        gather = _allgather_s(width * n, d, dp_bw, latency)
        if layout.zero_stage == 2:
            gathers = gather
        elif layout.hpz > 1:
            # hpZ: the backward gathers run within a group of hpz DP ranks (NVLink while TP x hpz fits a node)
            group_bw = gpu.nvlink_busbw_gbps if layout.tp * layout.hpz <= cluster.gpus_per_node else dp_bw
            gathers = m * (gather + _allgather_s(width * n, layout.hpz, group_bw, latency))
        else:
            gathers = 2 * m * gather
        dp = scatter + gathers
    else:
        # the routed experts' gradients go over their expert-data-parallel group (DP / EP ranks) instead
        dp = _allreduce_s(bytes_grad * (n - n_experts), d, dp_bw, latency)
        if layout.precision == "bf16" and layout.zero_stage >= 1:
            dp += _allgather_s(2 * (n - n_experts), d, dp_bw, latency)
        if n_experts:
            dp += _allreduce_s(bytes_grad * n_experts, layout.expert_replicas, dp_bw, latency)
            if layout.precision == "bf16" and layout.zero_stage >= 1:
                dp += _allgather_s(2 * n_experts, layout.expert_replicas, dp_bw, latency)
    return dp


def estimate_step(model: ModelShape, layout: Layout, gpu: GPUSpec, cluster: ClusterSpec, seq_length: int,
                  global_batch_size: int) -> StepEstimate:
    m = layout.num_micro_batches(global_batch_size)
    tp_bw, dp_bw, pp_bw = _bandwidths(layout, gpu, cluster)
    layers = stage_layer_counts(model, layout)
    params = stage_param_counts(model, layout)
    moe_layers = model.moe.stage_moe_layers(layers) if model.moe is not None else [0] * layout.pp
    fp8_layers = stage_fp8_layers(model, layers)
    slots = [_stage_slot(model, layout, gpu, cluster, seq_length, layers[i], params[i], i == 0,
                         i == layout.pp - 1, tp_bw, moe_layers[i], fp8_layers[i]) for i in range(layout.pp)]
    slowest = max(range(layout.pp), key=lambda i: sum(slots[i].values()))
    slot = dict(slots[slowest])
    if layout.pp > 1:
        # DeepSpeed sends 1/t of the activation (pipe_partitioned) and all-gathers it over the TP group; an fp32
        # run's activations are fp32 (4 bytes), as schedule_costs.p2p_bytes_per_step counts them
        width = 4 if layout.precision == "fp32" else 2
        act_bytes = width * seq_length / layout.token_split * layout.micro_batch_size * model.hidden_size
        slot["pp_comm"] = 2 * (act_bytes / layout.tp / (pp_bw * 1e9) + cluster.p2p_latency_us * 1e-6)
        slot["pp_comm"] += 3 * _allgather_s(act_bytes, layout.tp, tp_bw, cluster.collective_latency_us)
        slot["pp_comm"] *= layout.virtual_stages  # interleaved: a send and a receive per chunk boundary
    slot_s = sum(slot.values())
    weight_pass = _weight_gemm_forward_s(model, layout, gpu, seq_length, layers[slowest], moe_layers[slowest],
                                         slowest == layout.pp - 1, fp8_layers[slowest], weight_grad=True)
    bubble = bubble_slots(layout.schedule, layout.pp, layout.virtual_stages, weight_pass / slot_s)
    n = max(params)
    n_experts = max(stage_expert_param_counts(model, layout)) if model.moe is not None else 0
    d = layout.weight_replicas
    dp = _dp_comm_s(model, layout, gpu, cluster, n, n_experts, m, dp_bw)
    tied = 0.0
    if layout.pp > 1 and model.tied_embeddings:
        tied = _allreduce_s(4 * model.vocab_size * model.hidden_size / layout.tp, 2, cluster.inter_node_gbps,
                            cluster.collective_latency_us)
    sp_norms = 0.0
    if layout.sequence_parallel:
        # each rank's norm (and row-parallel bias) gradients cover its s/t tokens only: summed over TP
        replicated = 2 * model.norm_params + (2 * model.hidden_size if model.add_bias_linear else 0)
        sp_norms = _allreduce_s(4 * max(layers) * replicated, layout.tp, tp_bw, cluster.collective_latency_us)
    shard = d if layout.zero_stage >= 1 else 1
    optimizer = (32 * n / shard + 4 * n) / (gpu.hbm_gbps * 1e9)
    if model.moe is not None and layout.zero_stage >= 1:  # the experts' Adam runs over DP / EP shards
        optimizer += 32 * n_experts * (1 / layout.expert_replicas - 1 / shard) / (gpu.hbm_gbps * 1e9)
    pipe = (m + bubble) * slot_s
    components = {k: v * (m + bubble) for k, v in slot.items()}
    components.update(dp_comm=dp, tied_embedding=tied, optimizer=optimizer)
    if layout.sequence_parallel:
        components["sp_norm_grads"] = sp_norms
    step = pipe + dp + tied + optimizer + sp_norms
    return StepEstimate(
        step_s=step, slot_s=slot_s, bubble_s=bubble * slot_s, components_s=components,
        model_flops=model.flops_per_iteration(seq_length, global_batch_size, False),
        hardware_flops=model.flops_per_iteration(seq_length, global_batch_size, layout.recompute),
        num_gpus=layout.world_size, tokens_per_step=global_batch_size * seq_length,
        peak_tflops=gpu.peak_bf16_tflops)

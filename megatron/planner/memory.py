"""Bytes per GPU of one pipeline stage: parameters, gradients, optimizer state, activations.

Static memory, N = parameters held by the rank (its TP shard of its stage; the tied word embedding
is on the first AND the last stage when PP > 1), d = DP size x Ulysses degree (the ranks that hold
the same weights; ZeRO shards over all of them). What the pinned DeepSpeed
(``megatron.engine.deepspeed_compat.PINNED_VERSION``) allocates:

  bf16 (BF16_Optimizer, the BLOOM path; DeepSpeed ZeRO "stage 0" and "1" both give it):
      bf16 weights 2N + fp32 gradient accumulation buffer 4N (the WHOLE stage, not sharded)
      + fp32 master 4N/d + Adam exp_avg, exp_avg_sq 8N/d, resident all the time, + the bf16 .grad
      2N from the first backward until the optimizer step frees it: 8N + 12N/d bytes at the peak.  ``zero_stage=0``
      in the planner means a replicated optimizer: 8N + 12N.
  fp32 (client AdamW, no ZeRO): weights 4N + Adam 8N resident + .grad 4N during the step = 16N.
  fp16, ZeRO stage 0 (DeepSpeed's FP16_UnfusedOptimizer around the client AdamW; BigScience's V100 runs):
      fp16 weights 2N + fp32 copies 4N + Adam 8N resident, + the fp16 .grad 2N from the first backward
      and, during the step, an fp32 copy of every gradient 4N: 20N at the peak. Read from the pinned
      DeepSpeed's unfused_optimizer.py, not measured (fp16 does not run on the CPU accelerator).

Each optimizer group's flat buffer is padded to a multiple of 2d elements (ignored: < 2d * 2 groups).

Activations per transformer layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", eqs. 2 and 4), bf16, t = TP, u = Ulysses degree:

      no SP:  s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes          (34 + 5as/h at t = 1)
      SP:     s*b*h*(34/t + 5*a*s/(h*t))
      Ulysses: s -> s/u in front (each rank holds s/u tokens); the scores, [a/(t*u), s, s] per rank,
              keep s in the 5as/h term: (s/u)*b*h*(... + 5*a*s/(h*t)).

  The 10 is what lies outside the TP region (both norms' inputs, the QKV and MLP inputs, two 1-byte
  dropout masks); sequence parallelism splits it over the TP ranks (the all-gathered QKV and MLP inputs
  are gathered again in backward, as Megatron-LM does; ``sp_saves_gathered_inputs`` for an
  implementation that keeps them). The 5as/h term is the materialized attention softmax, its dropout
  mask and output; ``Layout.store_attention_scores = False`` (a flash / flex kernel, or selective
  recomputation of the core attention) drops it (flash's [b, np, s] fp32 log-sum-exp is negligible).
  With full recomputation a layer keeps only its input, 2*s*b*h bytes (/t with SP, /u with Ulysses:
  the layer's input is the rank's own shard), and one layer's full set is alive while it is
  recomputed and back-propagated. Under 1F1B (non-interleaved) stage i holds min(p - i, m)
  micro-batches in flight, so the first stage holds p of them; ZB-H1 and interleaved 1F1B hold what
  ``megatron.planner.schedule_costs`` derives (ZB-H1 adds the waiting weight-gradient passes' inputs). The
  first stage also keeps the embedding dropout mask (s*b*h bytes per micro-batch, split like a layer's input); the last stage the
  logits of one micro-batch: bf16 logits + fp32 copy for the loss + fp32 gradient = 10*s*b*V/t bytes
  (/u with Ulysses). fp32 runs: 4-byte activations (``activation_bytes_per_element``).
FP8 (``ModelShape.fp8``, ``megatron.planner.fp8``): no FP8 copy of the weights is kept (each GEMM quantizes the
weight it uses): ``fp8_transient``, the stage's largest FP8 weight in 1 byte per element; ``fp8_scaling_state``,
delayed scaling's fp32 history, scales and pending amaxes per FP8 linear layer; the FP8 layers' inputs kept for
backward in 1 byte per element (``fp8_kept_savings``).
Context parallelism (CP = c, ring attention): every term for s/c tokens, no scores, plus what the ring kernel
keeps and its buffers (``megatron.planner.context_parallel``).
The layer being back-propagated adds its activation gradients (~ one layer's set) and, with
recomputation, its recomputed activations. Runtime overhead (CUDA context, NCCL buffers): a flat
RUNTIME_OVERHEAD. A layout fits when the total is at most MEMORY_HEADROOM of the GPU's memory (the
caching allocator's fragmentation and short-lived buffers this model does not itemize).
"""

from __future__ import annotations

import dataclasses
import math

from megatron.config.schedules import get as get_schedule
from megatron.planner.candidate import Layout, stage_layer_counts
from megatron.planner.context_parallel import ring_buffer_bytes, ring_saved_bytes
from megatron.planner.fp8 import fp8_stage_bytes, stage_fp8_layers
from megatron.planner.moe import check_expert_layout
from megatron.planner.schedule_costs import check_schedule, first_chunk_in_flight, in_flight, peak_units
from megatron.planner.specs import GiB, ModelShape

RUNTIME_OVERHEAD = 3 * GiB   # assumption, not measured here: CUDA context ~0.5-1 GiB + NCCL buffers + workspaces
MEMORY_HEADROOM = 0.9        # rule of thumb: plan for 90% of the device, the rest goes to fragmentation


def stage_param_counts(model: ModelShape, layout: Layout) -> list[int]:
    """Parameters held by one TP rank of each pipeline stage (its EP rank's experts included)."""
    h, t = model.hidden_size, layout.tp
    counts = stage_layer_counts(model, layout)
    norm = model.norm_params
    embedding = model.vocab_size * h // t + model.learned_positions * h + (norm if model.embed_layernorm else 0)
    # The output head: the word embedding alone (the tied copy on the last stage is LMHeadPipe, without
    # positions or the embedding LayerNorm), or the untied output layer.
    head = model.vocab_size * h // t
    out, first_layer = [], 0
    for i, n_layers in enumerate(counts):
        n = sum(sum(model.layer_params_split(j, t, layout.ep, layout.etp))
                for j in range(first_layer, first_layer + n_layers))
        first_layer += n_layers
        if i == 0:
            n += embedding
        if i == layout.pp - 1:
            n += norm  # final norm
            if layout.pp > 1 or not model.tied_embeddings:
                n += head  # the tied copy of the word embedding (or an untied head)
            n += model.mtp_params(t, layout.ep, layout.etp)  # the MTP depths
            if model.mtp_num_layers and layout.pp > 1 and not model.tied_embeddings:
                n += model.vocab_size * h // t  # their copy of the word embedding, beside the untied head
        out.append(n)
    return out


def stage_expert_param_counts(model: ModelShape, layout: Layout) -> list[int]:
    """The routed experts' parameters held by one (TP, EP) rank of each pipeline stage (0 for a dense model)."""
    out, first_layer = [], 0
    for n_layers in stage_layer_counts(model, layout):
        out.append(sum(model.layer_params_split(j, layout.tp, layout.ep, layout.etp)[1]
                       for j in range(first_layer, first_layer + n_layers)))
        first_layer += n_layers
    out[-1] += sum(model.layer_params_split(model.num_layers + k, layout.tp, layout.ep, layout.etp)[1]
                   for k in range(model.mtp_num_layers))  # the MTP depths' experts, on the last stage
    return out


RESIDENT = ("weights", "grad_buffer", "master", "adam")  # allocated at start-up, alive between steps


def static_bytes(num_params: int, layout: Layout, expert_params: int = 0) -> dict[str, float]:
    """Weights, gradients and optimizer state of one rank holding ``num_params`` parameters
    (``grads``, the modules' .grad, live only from the first backward to the optimizer step, which
    frees them; the other components are RESIDENT). ``expert_params`` of them are routed experts, whose
    optimizer state ZeRO shards over the expert-data-parallel group (``layout.expert_replicas``) instead."""
    if expert_params:
        dense = static_bytes(num_params - expert_params, layout)
        experts = static_bytes(expert_params, dataclasses.replace(layout, dp=layout.expert_replicas, ulysses=1, cp=1, ep=1,
                                                                  etp=0))
        return {key: dense[key] + experts[key] for key in dense}
    n, shard = num_params, (layout.weight_replicas if layout.zero_stage >= 1 else 1)
    adam = layout.adam_state_bytes  # 8: both moments fp32
    if layout.zero_stage >= 2:
        return _sharded_static_bytes(n, layout)
    if layout.precision == "bf16":
        return {"weights": 2 * n, "grad_buffer": 4 * n, "master": 4 * n / shard, "adam": adam * n / shard,
                "grads": 2 * n}
    if layout.precision == "fp16" and layout.zero_stage == 0:
        # FP16_UnfusedOptimizer around the client AdamW: fp32 copies hold the Adam states; the step makes
        # an fp32 copy of every fp16 .grad before it updates
        return {"weights": 2 * n, "grad_buffer": 0.0, "master": 4 * n, "adam": adam * n, "grads": 2 * n + 4 * n}
    if layout.precision == "fp32":
        return {"weights": 4 * n, "grad_buffer": 0.0, "master": 0.0, "adam": adam * n / shard, "grads": 4 * n}
    raise ValueError(f"precision {layout.precision!r} with ZeRO stage {layout.zero_stage} is not modelled (bf16, "
                     f"fp32, and fp16 with ZeRO stage 0 are)")


def _sharded_static_bytes(n: int, layout: Layout) -> dict[str, float]:
    """ZeRO-2 / ZeRO-3 on DeepSpeed's model engine (megatron.engine.model_engine), d = DP:

    ZeRO-2: the full flat weights (2 or 4 bytes) N, fp32 master partition 4N/d, Adam 8N/d; gradients
        are reduced bucket by bucket into the partition's fp32 gradients (4N/d, during the step).
    ZeRO-3: weight partition (2 or 4 bytes) N/d (+ N/K for hpZ's secondary shard over groups of K),
        fp32 masters 4N/d, a resident gradient partition in the weights' dtype N/d, Adam 8N/d; the gathered working
        set (the layers being computed, prefetched) is
        not itemized, nor the parameters small enough to stay gathered (stage3_param_persistence_threshold).
    """
    d, width, adam = layout.weight_replicas, (2 if layout.precision == "bf16" else 4), layout.adam_state_bytes
    if layout.precision not in ("bf16", "fp32"):
        raise ValueError(f"precision {layout.precision!r} with ZeRO stage {layout.zero_stage} is not modelled "
                         f"(bf16 and fp32 are)")
    if layout.zero_stage == 2:
        return {"weights": width * n, "grad_buffer": 0.0, "master": 4 * n / d, "adam": adam * n / d, "grads": 4 * n / d}
    out = {"weights": width * n / d, "grad_buffer": width * n / d, "master": 4 * n / d, "adam": adam * n / d,
           "grads": 0.0}
    if layout.hpz > 1:  # hpZ's secondary copy of the weights, sharded over the hpz ranks of a group
        out["weights"] += width * n / layout.hpz
    return out


def activation_bytes_per_element(layout: Layout) -> int:
    return 4 if layout.precision == "fp32" else 2


def layer_activation_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int = 2, *,
                           sp_saves_gathered_inputs: bool = False, moe_layer: bool = False) -> float:
    """One layer, one micro-batch, on one rank: everything kept for backward (Korthikanti eqs. 2 and 4).

    With bytes_per_element w (2: bf16, Korthikanti's numbers), in units of s*b*h elements:
      outside TP  the two norms' inputs and outputs (the QKV and MLP inputs): 4w, plus 2 one-byte dropout
                  masks: 10 at w = 2. Divided by t with sequence parallelism.
      TP region   q and the context (w each, q_hidden wide), k and v (kv_hidden wide); the MLP: the h -> 4h output
                  and its GeLU (w x 4h each), 24 at w = 2. SwiGLU keeps gate and up (2f), silu(gate) and
                  the product (f each): twice a GeLU MLP's f + f. Divided by t.
      scores      softmax output and its dropout output (w each), the dropout mask (1 byte): (2w + 1)as/h,
                  5as/h at w = 2; divided by t; absent when ``layout.store_attention_scores`` is False.
    All of it for s/u tokens with Ulysses degree u; the scores keep s (full-sequence attention over a/(tu) heads).
    Ulysses with a fused kernel (no scores stored) keeps one more context-sized tensor, w per h: the kernel holds
    its output [s, b, a/(tu), hn] for backward and the dense projection the [s/u, b, a/t, hn] that the reverse
    all-to-all returns (without Ulysses these are one tensor; with stored scores the core keeps its probabilities
    and v, not its output). Measured on CPU, benchmarks/bench_sequence_memory.py.

    sp_saves_gathered_inputs: the SP implementation keeps the all-gathered [s, b, h] inputs of the QKV and
    MLP column-parallel layers for their weight gradients (2w at full size) instead of gathering them again.
    A tiny CPU model in fp32: ``layer_activation_bytes(model_shape_of(config), Layout(...), seq, 4)``.

    moe_layer: an MoE layer of ``model.moe`` (an estimate, dropless and balanced): the shared expert's MLP term and
    the k routed experts' (``_moe_mlp_width``), plus one set of k rows of h (the dispatched rows the experts' first
    GEMM keeps: k w per h, not split by TP: each TP rank routes every token, but with whole experts under SP; the
    returned rows are not kept, the routing weights being applied in the experts' activation), the routing's int64
    indices and weights (about 68k bytes per token) and the router's fp32 logits and scores (8E/h). Measured on CPU
    (tests/model/test_recompute_modules.py) within 1% of what recomputing the MoE MLP frees. FP8 layers keep less:
    ``fp8_kept_savings``.

    Multi-head latent attention (``model.mla``): q, k, the key / value up-projection (v a view of it) and the context
    at MLA's widths in the TP region, and its latents outside it (``ModelShape.mla_kept_widths``, measured).

    Without the parts ``layout.recompute_modules`` recomputes: ``layer_kept_bytes``.
    """
    if layout.cp > 1:  # ring attention: everything for s/c tokens, no scores (megatron.planner.context_parallel)
        local = dataclasses.replace(layout, cp=1, store_attention_scores=False)
        return (layer_activation_bytes(model, local, seq_length / layout.cp, bytes_per_element,
                                       sp_saves_gathered_inputs=sp_saves_gathered_inputs, moe_layer=moe_layer)
                + ring_saved_bytes(model, layout, seq_length, bytes_per_element))
    s, b, h, a = seq_length, layout.micro_batch_size, model.hidden_size, model.num_attention_heads
    t, u, w = layout.tp, layout.ulysses, bytes_per_element
    outside = 4 * w + 2
    if layout.sequence_parallel:
        outside /= t
        if sp_saves_gathered_inputs:
            outside += 2 * w * (1 - 1 / t)
    second_context = 1 if u > 1 and not layout.store_attention_scores else 0
    attention = (2 * model.q_hidden / h + 2 * model.kv_hidden / h + second_context * model.q_hidden / h) * w
    if model.mla is not None:  # MLA: q, k, its k / v up-projection, the context; its latents beside the norms'
        heads_part, latents = model.mla_kept_widths
        attention = (heads_part + second_context * model.num_attention_heads * model.mla.v_head_dim) / h * w
        outside += latents / h * w / (t if layout.sequence_parallel else 1)
    mlp = (4 if model.swiglu else 2) * model.ffn / h * w
    routed = 0.0
    if moe_layer:
        mlp = _moe_mlp_width(model) / h * w
        routed = _routed_bytes_per_token(model, layout, w) / h
    scores = (2 * w + 1) * a * s / h if layout.store_attention_scores else 0.0
    return s / u * b * h * (outside + routed + (attention + mlp + scores) / t)


def _moe_mlp_width(model: ModelShape) -> float:
    """An MoE layer's MLP activations per token, in elements: the shared expert's as a dense MLP's ((4 SwiGLU | 2)
    f_s) and, for each of the k routed experts, its first GEMM's output (2 f_e SwiGLU | f_e), which the weighted
    activation keeps (megatron.model.moe.experts._WeightedActivation), and the weighted activation (f_e), the second
    GEMM's input: (3 | 2) k f_e."""
    moe = model.moe
    return ((4 if model.swiglu else 2) * moe.shared_expert_ffn
            + (3 if model.swiglu else 2) * moe.topk * moe.expert_ffn)


def _routed_bytes_per_token(model: ModelShape, layout: Layout, w: int) -> float:
    """An MoE layer's routing terms per token (``layer_activation_bytes``' moe_layer): one set of k rows of h (the
    dispatched rows, the experts' first GEMM's input; the returned rows are not kept: the routing weights are applied
    in the experts' activation, megatron.model.moe.dispatch), about eight int64 indices and the fp32 routing weight
    per choice, the router's fp32 logits and scores; on every TP rank, but with whole experts under SP (expert tensor
    parallelism 1), where each TP rank routes its own s/t tokens (megatron.model.moe.layer)."""
    k = model.moe.topk
    per_token = k * model.hidden_size * w + 68 * k + 8 * model.moe.num_experts
    if layout.sequence_parallel and layout.etp == 1 and layout.tp > 1:
        per_token /= layout.tp
    return per_token


def fp8_kept_savings(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int = 2, *,
                     moe_layer: bool = False) -> float:
    """What one FP8 layer keeps less than ``layer_kept_bytes`` says, one micro-batch, one rank: an FP8 linear layer
    keeps its input as dW's FP8 operand (1 byte per element and its fp32 scales: 4 / 128 bytes blockwise, 4 / 32
    mxfp8; megatron.parallel.fp8_linear) instead of w bytes, where nothing else keeps that input: the QKV input (the
    input norm's output; not MLA's, whose down-projections run in bf16), the output projection's input (the context)
    with stored scores, the MLP's two GEMMs' inputs; in an MoE layer the dispatched rows, the routed experts' and the
    shared expert's second GEMM's inputs. Where another op keeps the tensor anyway the FP8 copy adds its byte: the
    context under a fused attention kernel (kept as its output), the shared expert's input (the MLP input, which the
    router keeps). Nothing where ``layout.recompute_modules`` frees the tensor already. MLA's latents (its
    up-projections' inputs) are left at w: an over-estimate. Measured on CPU within 1%
    (tests/model/test_recompute_modules.py)."""
    if layout.cp > 1:
        local = dataclasses.replace(layout, cp=1, store_attention_scores=False)
        return fp8_kept_savings(model, local, seq_length / layout.cp, bytes_per_element, moe_layer=moe_layer)
    s, b, h, t, w = seq_length, layout.micro_batch_size, model.hidden_size, layout.tp, bytes_per_element
    block = {"blockwise": 128, "mxfp8": 32}.get(model.fp8.recipe if model.fp8 else "", 0)
    tokens = s / layout.ulysses * b
    copy = 1 + (4 * math.ceil(tokens / block) / tokens if block else 0)  # an FP8 element and its share of the
    saved = w - copy  # scales: one fp32 per feature and block of tokens (X^T quantized along t)
    modules = set(layout.recompute_modules)
    elements = 0.0  # per token
    norm_output = h / (t if layout.sequence_parallel else 1)  # an input norm's output, per token
    kept = 0.0  # per token: FP8 copies kept beside a tensor that stays
    if model.mla is None and "layernorm" not in modules:
        elements += norm_output  # the QKV input
    heads_width = (model.q_hidden if model.mla is None else model.num_attention_heads * model.mla.v_head_dim) / t
    if layout.store_attention_scores:
        elements += heads_width  # the context: only the output projection keeps it
    else:
        kept += heads_width * copy  # the fused kernel keeps its output: the FP8 copy beside it
    if not moe_layer:
        elements += 0 if "layernorm" in modules else norm_output  # the MLP input
        elements += 0 if "mlp" in modules else model.ffn / t
    elif "moe" not in modules:
        moe = model.moe
        routed = moe.topk * h / (t if layout.sequence_parallel and layout.etp == 1 and t > 1 else 1)
        elements += routed + (0 if "moe_act" in modules else moe.topk * moe.expert_ffn / t)
        elements += 0 if "shared_experts" in modules else moe.shared_expert_ffn / t
    if moe_layer and model.moe.shared_expert_ffn and not {"moe", "shared_experts"} & modules:
        kept += norm_output * copy  # the shared expert's input: the router keeps it
    return tokens * (elements * saved - kept)


def layer_kept_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int = 2, *,
                     moe_layer: bool = False) -> float:
    """``layer_activation_bytes`` less what ``layout.recompute_modules`` frees (``recompute_saved_bytes``): what one
    layer keeps for backward. (The step-time model reads ``layer_activation_bytes``: recomputing frees memory, not
    elementwise passes.)"""
    kept = layer_activation_bytes(model, layout, seq_length, bytes_per_element, moe_layer=moe_layer)
    if layout.recompute_modules:
        kept -= sum(recompute_saved_bytes(model, layout, seq_length, bytes_per_element, moe_layer=moe_layer).values())
    return kept


def recompute_saved_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int = 2, *,
                          moe_layer: bool = False) -> dict[str, float]:
    """What each of ``layout.recompute_modules`` (--recompute-modules) frees in one layer (an MoE layer of
    ``model.moe`` with ``moe_layer``), one micro-batch, on one rank: the tensors the part's consumers and its own
    backward would keep, less its inputs (kept). Per token (s/u or s/c of them), with w bytes per element, t = TP:
      core_attn       the stored scores, (2w + 1) a s / t (nothing with a fused kernel: store_attention_scores)
      layernorm       both norms' outputs, 2 h w (/t with SP), and their fp32 statistics (mean and 1/rms: 8 bytes
                      a LayerNorm, 4 an RMSNorm)
      mlp             a dense layer's MLP: its h -> f output and activation, (4 SwiGLU | 2) f w / t
      moe             an MoE layer's whole MLP term as ``layer_activation_bytes`` estimates it: the experts' and
                      shared expert's activations, the dispatched rows and the router's scores; the rest inside it
                      (moe_act, shared_experts) is then nothing more
      moe_act         the experts' weighted activation output (the second GEMM's input): k f_e w / t
      shared_experts  the shared expert's MLP: (4 | 2) f_s w / t
      mla_up_proj     MLA's up-projected key / value, np (dn + dv) w, and RoPE's cos / sin (2 dr w per position);
                      with a fused attention kernel (no stored scores) also the query and key it would keep,
                      2 np (dn + dr) w (with stored scores the core keeps its own scaled copies of them)
    Measured on CPU in fp32 (tests/model/test_recompute_modules.py): each within 1%."""
    if layout.cp > 1:
        local = dataclasses.replace(layout, cp=1, store_attention_scores=False)
        return recompute_saved_bytes(model, local, seq_length / layout.cp, bytes_per_element, moe_layer=moe_layer)
    s, b, h, t, w = seq_length, layout.micro_batch_size, model.hidden_size, layout.tp, bytes_per_element
    tokens = s / layout.ulysses * b
    modules = set(layout.recompute_modules)
    moe = model.moe if moe_layer else None
    out = {}
    for name in layout.recompute_modules:
        if name == "core_attn":
            per_token = (2 * w + 1) * model.num_attention_heads * s / t if layout.store_attention_scores else 0.0
        elif name == "layernorm":
            stats = 8 if model.normalization == "layernorm" else 4
            per_token = 2 * (h * w + stats) / (t if layout.sequence_parallel else 1)
        elif name == "mlp":
            per_token = 0.0 if moe else (4 if model.swiglu else 2) * model.ffn * w / t
        elif name == "moe":
            per_token = 0.0
            if moe:
                per_token = _moe_mlp_width(model) * w / t + _routed_bytes_per_token(model, layout, w)
        elif name == "moe_act":
            per_token = moe.topk * moe.expert_ffn * w / t if moe and "moe" not in modules else 0.0
        elif name == "shared_experts":
            per_token = (4 if model.swiglu else 2) * moe.shared_expert_ffn * w / t if moe and "moe" not in modules \
                else 0.0
        elif name == "mla_up_proj":
            if model.mla_head_dims is None:
                raise ValueError("mla_up_proj recomputes multi-latent attention's up-projections: the model has none")
            dn, dr, dv = model.mla_head_dims
            heads = model.num_attention_heads / t
            per_token = heads * (dn + dv + (0 if layout.store_attention_scores else 2 * (dn + dr))) * w
            out[name] = tokens * per_token + 2 * s / layout.ulysses * dr * w
            continue
        else:
            raise ValueError(f"--recompute-modules {name!r} is not a module the planner knows")
        out[name] = tokens * per_token
    return out


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    per_stage: list[dict[str, float]]   # component -> bytes, one dict per pipeline stage

    @property
    def totals(self) -> list[float]:
        return [sum(stage.values()) for stage in self.per_stage]

    @property
    def peak(self) -> float:
        return max(self.totals)

    @property
    def peak_stage(self) -> int:
        totals = self.totals
        return totals.index(max(totals))


def weight_pass_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int = 2) -> float:
    """One layer's deferred weight-gradient pass (ZB-H1's W, ``megatron.parallel.weight_grad_store``) on one rank:
    each linear keeps its input X and output gradient dY until dA = dY^T X runs. Per token, in elements:
      inputs   QKV and MLP-in (column-parallel, full h each), dense (q/t), MLP-out (f/t)
      grads    QKV (q + 2 kv)/t, MLP-in f/t (2f/t SwiGLU), dense and MLP-out (row-parallel, full h each)
    Measured on CPU (tests/planner/test_schedule_memory.py). With SP the column inputs are the gathered ones."""
    h, t, f = model.hidden_size, layout.tp, model.ffn
    inputs = 2 * h + (model.q_hidden + f) / t
    grads = (model.q_hidden + 2 * model.kv_hidden + (2 if model.swiglu else 1) * f) / t + 2 * h
    return seq_length / layout.token_split * layout.micro_batch_size * (inputs + grads) * bytes_per_element


def head_weight_pass_bytes(model: ModelShape, layout: Layout, seq_length: int, bytes_per_element: int = 2) -> float:
    """The vocab-parallel head's deferred W: its input [s, b, h] and the logits' gradient [s, b, V/t]."""
    tokens = seq_length / layout.token_split * layout.micro_batch_size
    return tokens * (model.hidden_size + model.vocab_size / layout.tp) * bytes_per_element


def activation_terms(model: ModelShape, layout: Layout, seq_length: int, global_batch_size: int) -> list[dict]:
    """Activation bytes of each stage by term, at the stage's peak under ``layout.schedule``:
      saved      the activations the layers keep for backward (less what --recompute-modules recomputes), of
                 every micro-batch in flight
                 (``megatron.planner.schedule_costs.in_flight``), plus ZB-H1's waiting W passes (the head's too)
      embedding  the first stage's embedding dropout masks (1 byte per element), one per micro-batch in flight
      logits     the last stage's logits of one micro-batch: the logits, an fp32 copy and its fp32 gradient (the
                 head's and each MTP depth's)
      mtp        (--mtp-num-layers) the last stage's MTP depths for that micro-batch: each its layer's saved
                 activations, its [2h] input and its projection's output
      backward   the layer being back-propagated: its activation gradients (~ one layer's set) and, with
                 recomputation, its recomputed activations; with CP also the ring's key / value blocks
    ``saved`` is what tests/planner/test_schedule_memory.py measures on the engine."""
    s, b, h, t, p = seq_length, layout.micro_batch_size, model.hidden_size, layout.tp, layout.pp
    w = activation_bytes_per_element(layout)
    m = layout.num_micro_batches(global_batch_size)
    # the layout flags' split: the run checked its chunks, which need not be equal
    check_schedule(layout.schedule, p, m, None if layout.layout_flags else model.num_layers,
                   layout.virtual_stages, layout.precision, layout.zero_stage)
    layers = stage_layer_counts(model, layout)
    if model.moe is not None:
        check_expert_layout(model.moe, layout.ep, t)
        moe_layers = model.moe.stage_moe_layers(layers)
    else:
        moe_layers = [0] * p
    full_layer = layer_activation_bytes(model, layout, seq_length, w)
    moe_layer = layer_activation_bytes(model, layout, seq_length, w, moe_layer=True) if model.moe else 0.0
    # --recompute-modules: each layer in flight keeps less; the one in backward holds its recomputed parts again
    kept_layer = layer_kept_bytes(model, layout, seq_length, w)
    kept_moe_layer = layer_kept_bytes(model, layout, seq_length, w, moe_layer=True) if model.moe else 0.0
    fp8_layers = stage_fp8_layers(model, layers)  # (dense, MoE) FP8 layers per stage: their inputs kept in FP8
    fp8_saves = (fp8_kept_savings(model, layout, seq_length, w),
                 fp8_kept_savings(model, layout, seq_length, w, moe_layer=True) if model.moe else 0.0)
    local_tokens = s * b / layout.sequence_split  # a layer's input and the embedding output: this rank's shard
    schedule = get_schedule(layout.schedule)  # the registry entry (megatron.config.schedules)
    w_layer = weight_pass_bytes(model, layout, seq_length, w) if schedule.defers_weight_passes else 0.0
    out = []
    for i in range(p):
        biggest = max(full_layer, moe_layer) if moe_layers[i] else full_layer
        if layout.recompute:
            one, working = layers[i] * w * local_tokens * h, 2 * biggest
        else:
            one = (layers[i] - moe_layers[i]) * kept_layer + moe_layers[i] * kept_moe_layer
            one -= fp8_layers[i][0] * fp8_saves[0] + fp8_layers[i][1] * fp8_saves[1]
            working = biggest
        weight_pass = layers[i] * w_layer
        if w_layer and i == p - 1:
            weight_pass += head_weight_pass_bytes(model, layout, seq_length, w)
        terms = {"saved": peak_units(layout.schedule, p, m, i, one, weight_pass, layout.virtual_stages),
                 "embedding": 0.0, "logits": 0.0, "backward": working}
        # CP: the ring's key / value (and dK / dV) blocks while a layer runs backward
        terms["backward"] += ring_buffer_bytes(model, layout, s, w)
        if i == 0:
            first = (first_chunk_in_flight(p, m, layout.virtual_stages) if schedule.uses_virtual_stages
                     else in_flight(layout.schedule, p, m, 0))
            terms["embedding"] = first * local_tokens * h  # embedding dropout mask (1 byte per element)
        if i == p - 1:
            # logits, fp32 copy, gradient: the head's and each MTP depth's (all alive until the loss's backward)
            terms["logits"] = (1 + model.mtp_num_layers) * (w + 8) * s / layout.token_split * b * model.vocab_size / t
            if model.mtp_num_layers:  # the depths of the micro-batch whose loss runs: their layer (not recomputed),
                # the concatenated [2h] input and the projection's output
                depth_layer = moe_layer if model.is_moe_layer(model.num_layers) else full_layer
                terms["mtp"] = model.mtp_num_layers * (depth_layer + 3 * w * local_tokens * h)
        out.append(terms)
    return out


def estimate_memory(model: ModelShape, layout: Layout, seq_length: int, global_batch_size: int) -> MemoryEstimate:
    stages = []
    experts = stage_expert_param_counts(model, layout)
    terms = activation_terms(model, layout, seq_length, global_batch_size)
    fp8_layers = stage_fp8_layers(model, stage_layer_counts(model, layout))
    for i, n_params in enumerate(stage_param_counts(model, layout)):
        stage = dict(static_bytes(n_params, layout, experts[i]))
        if layout.zero_stage == 3:
            # the gathered full weights of the layer being computed and of the one prefetched (an estimate:
            # DeepSpeed's stage3_prefetch_bucket_size / max_live_parameters bound it, not modelled exactly)
            stage["gathered"] = 2 * (2 if layout.precision == "bf16" else 4) * model.layer_params(layout.tp)
        stage.update(activations=sum(terms[i].values()), overhead=RUNTIME_OVERHEAD)
        if model.fp8 is not None:  # no FP8 weight copy kept: one GEMM's quantized weight, delayed scaling's buffers
            stage.update(fp8_stage_bytes(model, layout.tp, *fp8_layers[i]))
        stages.append(stage)
    return MemoryEstimate(stages)

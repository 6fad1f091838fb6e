"""One-GPU training throughput (tokens/s, TFLOPs, MFU, peak memory) and ALiBi attention kernels.

NOT RUN YET: written and dry-run on CPU only (the build machine has no GPU). On a GPU machine:

    python -m benchmarks.bench_gpu --output benchmarks/results/gpu_<date>.json
    python -m benchmarks.bench_gpu --dry-run          # CPU, tiny config: checks the script end to end

1. Training: our engine (the same DeepSpeed PipelineEngine + BF16_Optimizer pretrain() builds,
   TP = PP = DP = 1, nccl) on a BLOOM-1B3-like model (24 layers, hidden 2048, 16 heads, seq 2048,
   250,880-row vocabulary) and a Llama-style 1B (Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads
   in 8 query groups, SwiGLU 8192, RMSNorm, rotary, untied, 128,256-row vocabulary), bf16,
   micro-batch = global batch (--micro-batch-size), --steps timed steps after --warmup ones, per
   VARIANTS entry: --attention-backend sdpa / auto (flash if installed, else flex for ALiBi) and
   --torch-compile (first step, compilation included, reported apart). A failing variant reports its
   error and the others still run.
   Reported: median step time, tokens/s, model and hardware TFLOP/s (megatron.training.metrics,
   Megatron's formula), MFU against the device's dense bf16 peak (--peak-tflops overrides), and
   torch.cuda.max_memory_allocated, next to the planner's prediction for the same layout.
2. Attention with ALiBi, forward + backward of [b, np, s, hn] bf16 alone:
     plain  what megatron/model/attention.py does today: F.scaled_dot_product_attention with the
            materialized additive bias [np, s, s] (slope * (k - q), -inf above the diagonal)
     flex   torch.nn.attention.flex_attention (compiled) with an ALiBi score_mod and a causal
            block mask: no [np, s, s] tensor, fully masked blocks skipped
     plain_4d  the same bias passed as [1, np, s, s]: on CPU the 3-D mask makes SDPA fall back to its
            math path (materialized scores) and the 4-D one does not; which kernel CUDA picks is
            what this row shows
     causal SDPA is_causal=True without ALiBi: the fused kernel's speed of light, for scale
   The outputs of plain and flex are compared (max abs difference) before timing. If flex wins,
   the model needs it as a separate option in attention.py (the attention owner's change).
3. MoE experts, forward + backward of the local experts alone (megatron/model/moe/experts.py, SwiGLU, bf16, a
   Mixtral-8x7B-shaped layer: h 4096, f 14336, 8 experts, top-2 of 8192 tokens), balanced and skewed loads:
     segments     torch._grouped_mm on the rows sorted by expert, unpadded (the layer's path)
     padded       every expert padded to the busiest and one torch.bmm per matrix (the layer's fallback)
     loop         one mm per expert on its slice of rows, outputs concatenated
   Reported: median seconds, achieved TFLOP/s (18 M h f: three h x f matrices, forward and two backward
   products) and the largest output difference from segments. --dry-run: tiny shapes on CPU.
4. FP8 against bf16 (issue 39), forward + backward of the GEMMs of one Llama-3-8B layer (h 4096, 32 heads in 8
   query groups of 128: QKV 4096 -> 6144, the attention's dense 4096 -> 4096, SwiGLU's fused gate and up
   4096 -> 2 x 14336, down 14336 -> 4096; 8192 tokens) alone, each product as the model runs it:
     bf16              F.linear on bf16 operands
     fp8_<recipe>      megatron.parallel.fp8_linear.fp8_linear (--fp8-format hybrid) per recipe: tensorwise,
                       delayed (scales from the warm-up call's amaxes, update_fp8_scales), blockwise (one row-wise _scaled_mm per
                       128 K block, partials summed in fp32), mxfp8 (the same per 32 K block); the operands
                       quantized from bf16 inside the timed call, as the layer does every call
   Reported per path: the layer's median seconds (the sum over its four products), achieved TFLOP/s (6 M K N per
   product), MFU against the device's dense bf16 peak and against its dense FP8 peak (PEAK_FP8_TFLOPS, datasheet:
   1979 on H100 / H200 SXM), the speed against bf16's, and the output's largest error against bf16's relative to
   its largest value. A path that fails reports its error. --dry-run: tiny shapes on CPU (no MFU).
   NOT RUN on a GPU yet.
--sections picks which of the four run (default all). Without CUDA and without --dry-run the script exits at
once naming the missing device (nothing is measured on CPU).
Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch  # noqa: E402

from benchmarks import (
    _common,  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
    bench_attention,
)
from benchmarks._common import emit, machine, tiny_argv, tiny_corpus
from megatron.config.hardware import PEAK_FP8_TFLOPS  # dense FP8 peaks (datasheet); the A100 has none

LLAMA = dict(position_embedding_type="rotary", normalization="rmsnorm", swiglu=True, disable_bias_linear=True,
             untie_embeddings_and_output_weights=True, embed_layernorm=False)
SIZES = {"1B3": dict(num_layers=24, hidden_size=2048, num_attention_heads=16),
         "350M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
         # Llama-3.2-1B-like: 16 layers, hidden 2048, 32 heads in 8 query groups, SwiGLU 8192, 128256-row vocabulary
         "llama1B": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                         ffn_hidden_size=8192, **LLAMA)}
VOCAB = {"1B3": 250880, "350M": 250880, "llama1B": 128256}
DRY = {"tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4),
       "tiny_llama": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          ffn_hidden_size=128, **LLAMA)}
# (model, --attention-backend, --torch-compile): every path the model has, on the sizes the issue names.
# auto on CUDA: flash where flash-attn is installed, else flex for ALiBi and sdpa (is_causal) for rotary.
VARIANTS = (("1B3", "sdpa", False), ("1B3", "auto", False), ("1B3", "auto", True),
            ("llama1B", "sdpa", False), ("llama1B", "sdpa", True))
DRY_VARIANTS = (("tiny", "sdpa", False), ("tiny", "flex", False), ("tiny_llama", "auto", False))
# Llama-3-8B's layer: hidden 4096, 32 heads in 8 query groups of 128, SwiGLU 14336
LLAMA3_8B_LAYER = dict(hidden=4096, heads=32, query_groups=8, ffn=14336)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_throughput(name: str, sizes: dict, seq: int, mbs: int, steps: int, warmup: int, device: str,
                     peak_override, attention_backend: str = "auto", compiled: bool = False) -> dict:
    from benchmarks.bench_train_vs_transformers import Ours  # same engine construction as pretrain()
    from megatron.planner import GPUS, estimate_memory
    from megatron.planner.candidate import Layout
    from megatron.planner.specs import model_shape_of
    from megatron.training.metrics import current_device_name, peak_tflops_for_device, throughput_metrics

    corpus = tiny_corpus()
    argv = tiny_argv(corpus, train_iters=1000, lr_warmup_iters=0, lr_decay_style="constant", min_lr=0.0,
                     seq_length=seq, micro_batch_size=mbs, global_batch_size=mbs, **sizes,
                     distributed_backend="nccl" if device == "cuda" else "gloo", attention_backend=attention_backend,
                     torch_compile=compiled)
    if device == "cuda":
        argv += ["--pad-vocab-size-to", str(VOCAB[name])]
    start = time.perf_counter()
    ours = Ours(argv + ["--bf16"], backend="nccl" if device == "cuda" else "gloo")
    it = ours.iterator_factory()
    batches = [[next(it)] for _ in range(4)]
    if device == "cuda":
        batches = [[tuple(tuple(t.cuda() for t in part) for part in mb) for mb in b] for b in batches]
        torch.cuda.reset_peak_memory_stats()
    times = []
    first_step_s = None
    for i in range(warmup + steps):
        _sync(device)
        t = time.perf_counter()
        ours.step(batches[i % len(batches)])
        _sync(device)
        if i == 0:
            first_step_s = time.perf_counter() - t  # compilation included under --torch-compile
        if i >= warmup:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    peak = peak_tflops_for_device(current_device_name(), peak_override)
    flops = throughput_metrics(ours.rc.model, mbs, False, step, 1, peak)
    out = {"model": name, **sizes, "attention_backend": attention_backend, "torch_compile": compiled,
           "first_step_s": first_step_s, "build_and_first_step_s": time.perf_counter() - start - sum(times),
           "seq_length": seq, "micro_batch_size": mbs,
           "padded_vocab_size": ours.rc.model.padded_vocab_size, "median_step_s": step,
           "tokens_per_s": mbs * seq / step, **flops, "peak_tflops": peak, "step_s_all": times}
    if device == "cuda":
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        gpu = GPUS["H200-141GB"] if "H200" in current_device_name() else GPUS["H100-80GB"]
        # flash / flex / SDPA's fused kernels keep no [np, s, s] scores; the explicit ALiBi bias of sdpa does
        alibi = sizes.get("position_embedding_type", "alibi") == "alibi"
        layout = Layout(1, 1, 1, mbs, recompute=False, zero_stage=0,
                        store_attention_scores=alibi and attention_backend == "sdpa")
        mem = estimate_memory(model_shape_of(ours.rc.model), layout, seq, mbs)
        out["planner_predicted_gib"] = mem.peak / 2 ** 30
        out["planner_gpu"] = gpu.name
    del ours
    return out


def attention_kernels(b: int, heads: int, seq: int, head_dim: int, reps: int, device: str) -> dict:
    import torch.nn.functional as F

    from megatron.model.positional import alibi_bias, alibi_slopes_for_rank

    dtype = torch.bfloat16
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    slopes = alibi_slopes_for_rank(heads, 0, 1).to(device)
    positions = torch.arange(seq, device=device)
    scale = 1.0 / head_dim ** 0.5

    def plain():
        bias = alibi_bias(slopes, positions, positions).to(dtype)  # [np, s, s], as the model builds it
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    def plain_4d():  # the proposed fix: on CPU a 3-D mask sends SDPA to its math path, a 4-D one does not
        bias = alibi_bias(slopes, positions, positions).to(dtype)[None]  # [1, np, s, s]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    def causal():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    paths = {"plain_sdpa_bias": plain, "plain_sdpa_bias_4d": plain_4d, "causal_sdpa_no_alibi": causal}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def alibi_score(score, batch, head, q_idx, kv_idx):
            return score + slopes[head] * (kv_idx - q_idx)

        def causal_mask(batch, head, q_idx, kv_idx):
            return q_idx >= kv_idx

        block_mask = create_block_mask(causal_mask, None, None, seq, seq, device=device)
        flex = torch.compile(flex_attention) if device == "cuda" else flex_attention

        def flex_path():
            if device == "cpu":  # FlexAttention has no backward on CPU: forward only (dry run)
                return flex(q.detach(), k.detach(), v.detach(), score_mod=alibi_score, block_mask=block_mask,
                            scale=scale)
            return flex(q, k, v, score_mod=alibi_score, block_mask=block_mask, scale=scale)

        paths["flex_alibi"] = flex_path
    except Exception as exc:  # noqa: BLE001 - report why flex is unavailable instead of failing
        paths_error = repr(exc)
    else:
        paths_error = None

    out = {"shape_b_np_s_hn": [b, heads, seq, head_dim], "flex_error": paths_error}
    reference = plain().float()
    if "flex_alibi" in paths:
        out["flex_vs_plain_max_abs_diff"] = (paths["flex_alibi"]().float() - reference).abs().max().item()
    grad = torch.randn_like(reference).to(dtype)
    for name, fn in paths.items():
        forward_only = device == "cpu" and name == "flex_alibi"

        def run():
            out_ = fn()
            if not forward_only:
                out_.backward(grad)

        for _ in range(2):  # warm-up (compilation for flex)
            run()
        median = bench_attention.median_time(run, reps, device)
        flops = 4 * b * heads * seq * seq * head_dim * 3 / 2  # fwd + bwd, causal half
        out[name] = {"median_fwd_bwd_s": median, "forward_only": forward_only,
                     "tflops_causal": flops / median / 1e12}
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            run()
            out[name]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return out


def moe_experts(tokens: int, hidden: int, ffn: int, num_experts: int, topk: int, reps: int, device: str,
                dtype: torch.dtype = torch.bfloat16, skews=(0.0, 2.0)) -> dict:
    """The local experts' forward + backward per path (module docstring, section 3), per load skew."""
    import torch.nn.functional as F

    from megatron.model.moe.experts import GroupedExperts

    def init(e):
        return lambda t: t.normal_(0, 0.02, generator=torch.Generator().manual_seed(e))

    experts = GroupedExperts(hidden, ffn, range(num_experts), swiglu=True, bias=False, w1_init=init,
                             w2_init=lambda e: init(num_experts + e)).to(device=device, dtype=dtype)
    rows_n = tokens * topk
    flops = 18 * rows_n * hidden * ffn

    def loop(rows, counts):
        outs = []
        for e, part in enumerate(rows.split(counts.tolist())):
            gate, up = (part @ experts.w1[e].t()).unflatten(-1, (-1, 2)).unbind(-1)
            outs.append((F.silu(gate) * up) @ experts.w2[e].t())
        return torch.cat(outs)

    def with_path(path):
        def run(rows, counts):
            experts.path = path
            return experts(rows, counts)
        return run

    out = {"shape": dict(tokens=tokens, hidden=hidden, ffn=ffn, num_experts=num_experts, topk=topk),
           "dtype": str(dtype), "flops": flops}
    for skew in skews:
        weights = torch.ones(num_experts)
        weights[0] += skew * num_experts / 2  # skew 2: expert 0 takes about half the rows
        counts = torch.distributions.Multinomial(rows_n, weights / weights.sum()).sample().long()
        rows = torch.randn(rows_n, hidden, device=device, dtype=dtype)
        grad = torch.randn_like(rows)
        entry = {"counts": counts.tolist()}
        counts = counts.to(device)
        reference = None
        for name, fn in (("segments", with_path("segments")), ("padded", with_path("padded")), ("loop", loop)):
            try:
                def step():
                    x = rows.detach().requires_grad_()
                    y = fn(x, counts)
                    y.backward(grad)
                    return y

                y = step().detach()
                reference = y if reference is None else reference
                step()  # warm-up
                median = bench_attention.median_time(step, reps, device)
                entry[name] = {"median_fwd_bwd_s": median, "tflops": flops / median / 1e12,
                               "max_abs_diff_vs_segments": (y.float() - reference.float()).abs().max().item()}
            except Exception as exc:  # noqa: BLE001 - a path that does not run here is reported, not fatal
                entry[name] = {"error": repr(exc)[:500]}
            experts.zero_grad(set_to_none=True)
        out[f"skew_{skew:g}"] = entry
    experts.path = "auto"
    return out


def fp8_layer_gemms(tokens: int, hidden: int, heads: int, query_groups: int, ffn: int, reps: int, device: str,
                    recipes=("tensorwise", "delayed", "blockwise", "mxfp8"), peak_override=None) -> dict:
    """Section 4: the products of one Llama-style layer, forward + backward, bf16 F.linear against fp8_linear per
    recipe (module docstring)."""
    import torch.nn.functional as F

    from megatron.config.fp8 import FP8Config
    from megatron.parallel.fp8_linear import FP8Scaling, fp8_linear, update_fp8_scales
    from megatron.training.metrics import current_device_name, peak_tflops_for_device

    head_dim = hidden // heads
    products = {"qkv": (hidden, hidden + 2 * query_groups * head_dim), "dense": (hidden, hidden),
                "gate_up": (hidden, 2 * ffn), "down": (ffn, hidden)}  # name -> (in K, out N)
    gen = torch.Generator(device=device).manual_seed(0)
    operands = {}
    for name, (k, n) in products.items():
        operands[name] = (torch.randn(tokens, k, generator=gen, device=device, dtype=torch.bfloat16),
                          torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * 0.02,
                          torch.randn(tokens, n, generator=gen, device=device, dtype=torch.bfloat16))
    flops = sum(6 * tokens * k * n for k, n in products.values())
    name = current_device_name() if device == "cuda" else None
    peak_bf16 = peak_tflops_for_device(name, peak_override)
    peak_fp8 = next((v for key, v in PEAK_FP8_TFLOPS.items() if name and key in name.upper()), None)

    def layer(recipe):
        """The layer's four products with their own weights and (FP8) their own scaling, as the model has them."""
        weights = {p: w.detach().clone().requires_grad_() for p, (_, w, _) in operands.items()}
        fp8 = {p: None if recipe is None else
               FP8Scaling(FP8Config(fp8_format="hybrid", fp8_recipe=recipe)).to(device) for p in products}

        def run():
            outs = {}
            for p, (x, _, dy) in operands.items():
                w = weights[p]
                w.grad = None
                y = F.linear(x, w) if fp8[p] is None else fp8_linear(x, w, None, fp8[p])
                y.backward(dy)
                outs[p] = y.detach()
            return outs
        return run, [f for f in fp8.values() if f is not None]

    paths = {"bf16": layer(None)}
    for recipe in recipes:
        paths[f"fp8_{recipe}"] = layer(recipe)
    out = {"shape": dict(tokens=tokens, hidden=hidden, heads=heads, query_groups=query_groups, ffn=ffn),
           "products_k_n": products, "flops_fwd_bwd": flops, "peak_bf16_tflops": peak_bf16,
           "peak_fp8_tflops": peak_fp8}
    reference = None
    for path, (run, scalings) in paths.items():
        try:
            run()  # warm-up; delayed: its amaxes become the scales in use (the buffers start at scale 1)
            for scaling in scalings:
                update_fp8_scales(scaling)
            outs = run()  # the outputs compared
            reference = outs if reference is None else reference
            median = bench_attention.median_time(run, reps, device)
            tflops = flops / median / 1e12
            out[path] = {"median_fwd_bwd_s": median, "tflops": tflops,
                         "mfu_vs_bf16_peak": tflops / peak_bf16 if peak_bf16 else None,
                         "mfu_vs_fp8_peak": tflops / peak_fp8 if peak_fp8 else None,
                         "rel_error_vs_bf16": max((outs[p].float() - reference[p].float()).abs().max().item()
                                                  / reference[p].float().abs().max().item() for p in products)}
        except Exception as exc:  # noqa: BLE001 - a path that does not run here is reported, not fatal
            out[path] = {"error": repr(exc)[:500]}
        if device == "cuda":
            torch.cuda.empty_cache()
    for path in paths:
        if "median_fwd_bwd_s" in out[path] and "median_fwd_bwd_s" in out["bf16"]:
            out[path]["speed_vs_bf16"] = out["bf16"]["median_fwd_bwd_s"] / out[path]["median_fwd_bwd_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: check the script, no figures")
    p.add_argument("--models", nargs="+", default=["1B3", "llama1B"], choices=sorted(SIZES),
                   help="models whose VARIANTS run (every attention path and --torch-compile of each)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--sections", nargs="+", default=["training", "attention", "moe", "fp8"],
                   choices=["training", "attention", "moe", "fp8"])
    p.add_argument("--fp8-tokens", type=int, default=8192, help="tokens of the FP8 section's Llama-3-8B layer")
    args = p.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on CPU")
    os.environ["DS_ACCELERATOR"] = "cpu" if device == "cpu" else "cuda"
    before = machine()
    attn = backends = moe = fp8 = None
    if args.dry_run:
        sizes, variants, seq, mbs, steps, warmup = DRY, DRY_VARIANTS, 64, 2, 2, 1
        if "attention" in args.sections:
            attn = attention_kernels(1, 4, 64, 16, 2, device)
            backends = bench_attention.run([64], 1, 4, 16, "fp32", device, 1)
        if "moe" in args.sections:
            moe = moe_experts(64, 64, 96, 4, 2, 2, device)
        if "fp8" in args.sections:
            fp8 = fp8_layer_gemms(32, 64, 4, 2, 96, 1, device)
    else:
        sizes, seq, mbs = SIZES, args.seq_length, args.micro_batch_size
        variants = [v for v in VARIANTS if v[0] in args.models]
        steps, warmup = args.steps, args.warmup
        if "attention" in args.sections:
            attn = {"s2048": attention_kernels(mbs, 16, seq, 128, 10, device),
                    "s2048_hn64": attention_kernels(mbs, 16, seq, 64, 10, device)}
            # The model's own paths (--attention-backend sdpa / flex / flash where installed), bf16.
            backends = bench_attention.run([2048, 8192], 1, 16, 128, "bf16", device, 5)
        if "moe" in args.sections:  # Mixtral-8x7B's experts, top-2 of 8192 tokens
            moe = moe_experts(8192, 4096, 14336, 8, 2, 10, device)
            torch.cuda.empty_cache()
        if "fp8" in args.sections:  # Llama-3-8B's layer GEMMs, FP8 against bf16
            fp8 = fp8_layer_gemms(args.fp8_tokens, **LLAMA3_8B_LAYER, reps=5, device=device,
                                  peak_override=args.peak_tflops)
            torch.cuda.empty_cache()
    if "training" not in args.sections:
        variants = ()
    training = {}
    for name, backend, compiled in variants:
        key = f"{name}/{backend}{'/compiled' if compiled else ''}"
        try:
            training[key] = train_throughput(name, sizes[name], seq, mbs, steps, warmup, device, args.peak_tflops,
                                             backend, compiled)
        except Exception as exc:  # noqa: BLE001 - one failing path must not lose the others' figures
            training[key] = {"error": repr(exc)[:2000]}
        if device == "cuda":
            torch.cuda.empty_cache()
    models = {name: sizes[name] for name, _, _ in variants}
    gpu = {"name": torch.cuda.get_device_name(), "cuda": torch.version.cuda} if device == "cuda" else None
    emit({"benchmark": "gpu", "dry_run": args.dry_run, "device": device, "gpu": gpu,
          "config": {"models": models, "seq_length": seq, "micro_batch_size": mbs, "steps": steps, "warmup": warmup,
                     "variants": [list(v) for v in variants],
                     "precision": "bf16 + BF16_Optimizer", "layout": "TP=PP=DP=1", "recompute": False},
          "compared_with": "the device's dense bf16 peak (MFU) and the planner's memory prediction; "
                           "attention: plain SDPA+bias vs FlexAttention ALiBi vs causal SDPA; fp8: fp8_linear per "
                           "recipe vs bf16 F.linear on Llama-3-8B's layer GEMMs, MFU vs the bf16 and FP8 peaks",
          "training": training, "attention": attn, "attention_backends": backends, "moe_experts": moe,
          "fp8_layer": fp8,
          "machine": before}, args.output)


if __name__ == "__main__":
    main()

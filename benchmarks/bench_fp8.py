"""FP8 on CPU (--fp8-format, issue 39): the GEMM, one linear layer and one training step, FP8 recipes against bf16
and fp32, one process, side by side in one run (repetitions alternated, the order rotated every repetition).

    flock /work/cpu.lock python -m benchmarks.bench_fp8 --output benchmarks/results/fp8_<date>.json

1. gemm: Y [M, N] = X [M, K] @ W [N, K]^T at Llama-3-8B-like layer shapes scaled down to a CPU (--gemm-shapes,
   M tokens x K in x N out; default the MLP's up and down projections at tokens 1024, hidden 1024, ffn 3.5 x
   hidden as Llama-3-8B's 14336 / 4096 (1024x1024x3584, 1024x3584x1024), and a larger square 2048^3), per path:
       fp32, bf16              torch.matmul on operands of that dtype (bf16 out)
       fp8_<recipe>            megatron.parallel.fp8_quantize.scaled_mm on operands quantized beforehand (the
                               GEMM alone): tensorwise one torch._scaled_mm (delayed's GEMM is the same call);
                               blockwise (1 x 128 / 128 x 128) and mxfp8 (1 x 32) one row-wise _scaled_mm per K
                               block, the partial products summed in fp32
       fp8_<recipe>_quantized  the same with both operands quantized from bf16 inside the timed call, as the
                               layer does it every call (tensorwise: amax, scale, scaled cast; blocks: per-block
                               amax and scales)
       fp8_<recipe>_dequantized_fp32  not what the layer does: the same quantized operands dequantized to fp32
                               (fp8_quantize.dequantize) and one fp32 matmul, what a CPU-only scaled_mm could do
                               instead (the products of FP8 values and power-of-two scales are exact in fp32;
                               the sums differ in order only), timed with its dequantization
   Reported per path: median ms, GFLOP/s (2 M N K), the time against bf16's, and the output's largest error
   against the fp32 product relative to its largest value (a sanity check that the path computed the product).
2. linear: one layer's forward + backward (Y = X W^T; dX, dW) at --linear-shape: megatron.parallel.fp8_linear
   .fp8_linear per recipe (tensorwise, delayed, blockwise, mxfp8; --fp8-format hybrid, bf16 operands) against
   F.linear in bf16 and in fp32. 6 M N K FLOPs. Delayed scaling's scales are updated (update_fp8_scales) once
   after the first call, so that the measured calls use scales from an amax history as in training.
3. step: one training step (DeepSpeed PipelineEngine + BF16_Optimizer, built as pretrain() builds it:
   benchmarks.bench_train_vs_transformers.Ours) of a small Llama-style model (rotary, RMSNorm, SwiGLU, grouped
   query attention, untied embeddings; --step-* sizes) with --bf16 against --bf16 --fp8-format hybrid
   --fp8-recipe <each>; after every step megatron.parallel.fp8_linear.update_fp8_scales, as the training loop
   calls it (delayed scaling's history and scales). Reported: median seconds per step, tokens/s, the first
   loss (the same batches and initial weights for every variant), the number of layers running FP8.

On a CPU, torch._scaled_mm has no FP8 hardware to run on (no x86 CPU multiplies FP8): expect every FP8 path to
be slower than bf16 here; the figures measure the cost of the code path, not what FP8 gains on an H100
(benchmarks/bench_gpu.py --sections fp8 measures that). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks import _common  # noqa: F401  (first: sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import emit, machine, tiny_argv, tiny_corpus
from benchmarks.bench_attention import cpu_flags
from megatron.config.fp8 import FP8Config
from megatron.parallel.fp8_linear import INPUT, WEIGHT, FP8Scaling, fp8_linear, update_fp8_scales
from megatron.parallel.fp8_quantize import dequantize, scaled_mm

RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
GEMM_RECIPES = ("tensorwise", "blockwise", "mxfp8")  # delayed's GEMM is tensorwise's (a scale given, not measured)
LLAMA = dict(position_embedding_type="rotary", normalization="rmsnorm", swiglu=True, disable_bias_linear=True,
             untie_embeddings_and_output_weights=True, embed_layernorm=False)


def alternated(fns: dict, reps: int, warmup: int) -> dict:
    """name -> seconds of each of ``reps`` calls of fns[name](), the paths alternated (order rotated each
    repetition) after ``warmup`` calls of each."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def summary(seconds: list[float], flops: float) -> dict:
    median = statistics.median(seconds)
    return {"median_ms": round(median * 1e3, 3), "min_ms": round(min(seconds) * 1e3, 3),
            "max_ms": round(max(seconds) * 1e3, 3), "gflops": round(flops / median / 1e9, 3)}


def scaling(recipe: str) -> FP8Scaling:
    return FP8Scaling(FP8Config(fp8_format="hybrid", fp8_recipe=recipe))


def quantized_operands(fp8: FP8Scaling, x: torch.Tensor, w: torch.Tensor):
    """X and W quantized along K exactly as _FP8Linear.forward quantizes them."""
    x_scale = fp8.tensor_scale(x, INPUT) if fp8.per_tensor else None
    w_scale = fp8.tensor_scale(w, WEIGHT) if fp8.per_tensor else None
    return fp8.quantize(x, INPUT, x_scale), fp8.quantize(w, WEIGHT, w_scale)


def gemm(m: int, k: int, n: int, reps: int, warmup: int, recipes=GEMM_RECIPES) -> dict:
    """Section 1 at one shape."""
    generator = torch.Generator().manual_seed(0)
    x32 = torch.randn(m, k, generator=generator)
    w32 = torch.randn(n, k, generator=generator) * 0.02
    x16, w16 = x32.bfloat16(), w32.bfloat16()
    fns = {"fp32": lambda: x32 @ w32.t(), "bf16": lambda: x16 @ w16.t()}
    for recipe in recipes:
        fp8 = scaling(recipe)
        qx, qw = quantized_operands(fp8, x16, w16)
        fns[f"fp8_{recipe}"] = lambda qx=qx, qw=qw: scaled_mm(qx, qw, torch.bfloat16)
        fns[f"fp8_{recipe}_quantized"] = lambda fp8=fp8: scaled_mm(*quantized_operands(fp8, x16, w16), torch.bfloat16)
        fns[f"fp8_{recipe}_dequantized_fp32"] = (
            lambda qx=qx, qw=qw: (dequantize(qx) @ dequantize(qw).t()).to(torch.bfloat16))
    reference = fns["fp32"]()
    scale = reference.abs().max().item()
    errors = {name: (fn().float() - reference).abs().max().item() / scale for name, fn in fns.items()}
    flops = 2 * m * n * k
    return {"m_tokens": m, "k_in": k, "n_out": n, "gflop": flops / 1e9,
            "paths": _timed_rows(fns, errors, flops, reps, warmup)}


def _timed_rows(fns: dict, errors: dict, flops: float, reps: int, warmup: int) -> dict:
    """Every path timed (alternated), with its error against fp32 and its time against bf16's."""
    times = alternated(fns, reps, warmup)
    rows = {name: {**summary(times[name], flops), "rel_error_vs_fp32": errors[name]} for name in fns}
    for row in rows.values():
        row["vs_bf16"] = round(row["median_ms"] / rows["bf16"]["median_ms"], 3)
    return rows


def linear(m: int, k: int, n: int, reps: int, warmup: int, recipes=RECIPES) -> dict:
    """Section 2: forward + backward of one bias-free linear layer."""
    generator = torch.Generator().manual_seed(0)
    x32 = torch.randn(m, k, generator=generator)
    w32 = torch.randn(n, k, generator=generator) * 0.02
    dy32 = torch.randn(m, n, generator=generator)

    def path(dtype, fp8=None):
        x = x32.to(dtype).detach().clone().requires_grad_()
        w = w32.to(dtype).detach().clone().requires_grad_()
        dy = dy32.to(dtype)

        def run():
            x.grad = w.grad = None
            y = F.linear(x, w) if fp8 is None else fp8_linear(x, w, None, fp8)
            y.backward(dy)
            return y.detach(), x.grad, w.grad
        return run

    fns = {"fp32": path(torch.float32), "bf16": path(torch.bfloat16)}
    scalings = {f"fp8_{recipe}": scaling(recipe) for recipe in recipes}
    for name, fp8 in scalings.items():
        fns[name] = path(torch.bfloat16, fp8)
    reference = fns["fp32"]()
    errors = {}
    for name, fn in fns.items():
        fn()
        if name in scalings:  # delayed: the amaxes of that call become the scales in use, as after a training
            update_fp8_scales(scalings[name])  # step (the buffers start at scale 1); other recipes: nothing
        out = fn()
        errors[name] = max((o.float() - r).abs().max().item() / r.abs().max().item() for o, r in zip(out, reference))
    flops = 6 * m * n * k
    return {"m_tokens": m, "k_in": k, "n_out": n, "gflop_fwd_bwd": flops / 1e9,
            "paths": _timed_rows(fns, errors, flops, reps, warmup)}


def step_argv(corpus: dict, args) -> list[str]:
    sizes = dict(num_layers=args.step_layers, hidden_size=args.step_hidden, num_attention_heads=args.step_heads,
                 num_key_value_heads=max(1, args.step_heads // 2), ffn_hidden_size=args.step_ffn, **LLAMA)
    return tiny_argv(corpus, train_iters=1000, lr_warmup_iters=0, lr_decay_style="constant", min_lr=0.0,
                     seq_length=args.step_seq, micro_batch_size=args.step_mbs, global_batch_size=args.step_mbs,
                     **sizes) + ["--bf16"]


def training_step(args, recipes=RECIPES) -> dict:
    """Section 3."""
    from benchmarks.bench_train_vs_transformers import Ours
    from megatron.parallel.fp8_linear import fp8_layers

    argv = step_argv(tiny_corpus(), args)
    variants = {"bf16": argv}
    variants.update({f"bf16_fp8_{r}": argv + ["--fp8-format", "hybrid", "--fp8-recipe", r] for r in recipes})
    runners, batches, rows = {}, None, {}
    for name, flags in variants.items():
        start = time.perf_counter()
        ours = runners[name] = Ours(flags)  # the same seed: the same initial weights
        if batches is None:
            it = ours.iterator_factory()
            batches = [[next(it)] for _ in range(4)]
        rows[name] = {"build_s": round(time.perf_counter() - start, 3),
                      "fp8_layers": len(fp8_layers(ours.engine.module))}
    counter = {name: 0 for name in variants}

    def stepper(name):
        ours = runners[name]

        def run():
            loss = ours.step(batches[counter[name] % len(batches)])
            update_fp8_scales(ours.engine.module)  # as the training loop's after_step (one process: no groups)
            if counter[name] == 0:
                rows[name]["first_loss"] = loss
            counter[name] += 1
        return run

    times = alternated({name: stepper(name) for name in variants}, args.step_reps, args.step_warmup)
    tokens = args.step_mbs * args.step_seq
    for name, row in rows.items():
        median = statistics.median(times[name])
        row.update({"median_step_s": round(median, 4), "min_step_s": round(min(times[name]), 4),
                    "max_step_s": round(max(times[name]), 4), "tokens_per_s": round(tokens / median, 1)})
    for row in rows.values():
        row["vs_bf16"] = round(row["median_step_s"] / rows["bf16"]["median_step_s"], 3)
    return {"model": {"layers": args.step_layers, "hidden": args.step_hidden, "heads": args.step_heads,
                      "query_groups": max(1, args.step_heads // 2), "ffn": args.step_ffn, "seq": args.step_seq,
                      "micro_batch": args.step_mbs, **LLAMA},
            "variants": rows}


def shape(text: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in text.lower().split("x"))
    return m, k, n


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemm-shapes", nargs="+", type=shape, default=[(1024, 1024, 3584), (1024, 3584, 1024), (2048, 2048, 2048)],
                    help="MxKxN: tokens x input features x output features")
    ap.add_argument("--linear-shape", type=shape, default=(1024, 1024, 3584))
    ap.add_argument("--step-layers", type=int, default=2)
    ap.add_argument("--step-hidden", type=int, default=256)
    ap.add_argument("--step-heads", type=int, default=8)
    ap.add_argument("--step-ffn", type=int, default=896)
    ap.add_argument("--step-seq", type=int, default=256)
    ap.add_argument("--step-mbs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per path (gemm, linear)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--step-reps", type=int, default=9, help="timed steps per variant (step)")
    ap.add_argument("--step-warmup", type=int, default=2)
    ap.add_argument("--sections", nargs="+", default=["gemm", "linear", "step"], choices=["gemm", "linear", "step"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start_machine, start = machine(), time.perf_counter()
    result = {"benchmark": "fp8", "unit": "milliseconds per call (gemm, linear), seconds per step (step); medians",
              "config": {k: v for k, v in vars(args).items() if k != "output"}, "cpu_flags": cpu_flags(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
              "machine_at_start": start_machine,
              "note": "CPU: no FP8 hardware; torch._scaled_mm's CPU path is slower than bf16 (and fp32) here, and "
                      "the block recipes' loop of one _scaled_mm per K block slower still. These figures are the "
                      "cost of the code path on this CPU, not FP8's speed on a GPU."}
    if "gemm" in args.sections:
        result["gemm"] = {f"{m}x{k}x{n}": gemm(m, k, n, args.reps, args.warmup) for m, k, n in args.gemm_shapes}
    if "linear" in args.sections:
        result["linear"] = linear(*args.linear_shape, args.reps, args.warmup)
    if "step" in args.sections:
        result["step"] = training_step(args)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    emit(result, args.output)
    return result


if __name__ == "__main__":
    main()

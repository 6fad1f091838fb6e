"""Training speed and memory on one CPU process: our engine vs a plain loop over transformers' Bloom.

Same architecture (BLOOM-style: ALiBi, embedding LayerNorm; 4 layers, hidden 256, 8 heads, seq 256,
micro-batch = global batch = 8, the tiny corpus's 400-token BPE padded to 512 rows on both sides),
same initial weights (ours exported with megatron.checkpoint.hf.bloom), same batches (our data iterator,
fed to both), AdamW (lr 1e-4 constant, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on 2-D weights
only, clip 1.0), no dropout. Variants, all in the same process:

  ours_bf16        pretrain()'s engine: DeepSpeed PipelineEngine, bf16 weights + BF16_Optimizer
                   (fp32 masters, fp32 gradient accumulation); one step = engine.train_batch + what
                   the training loop reads after it (loss.item(), grad norm)
  hf_autocast_bf16 BloomForCausalLM fp32 weights, forward under torch.autocast("cpu", bfloat16)
  hf_bf16          BloomForCausalLM cast to bf16, AdamW on bf16 weights (no fp32 masters)
  ours_model_autocast_bf16  our GPTModel (megatron.model) alone in the same plain loop as
                   hf_autocast_bf16: the model code's speed without DeepSpeed (weights identical)
  ours_bf16_unfused  ours_bf16 with --attention-backend unfused (matmuls and an fp32 softmax instead of SDPA's
                   fused CPU kernel: faster at short sequences in bf16, keeps the [b, np, s, s] probabilities)
  ours_fp32, hf_fp32
  *_compiled       the same with torch.compile: ours with --torch-compile (each transformer layer compiled),
                   transformers' model compiled whole (nn.Module.compile), the fair strong baseline

Losses: the first --loss-steps steps of each variant from the same weights on the same batches.
Speed: --reps repetitions of --steps-per-rep steps, variants alternated (rotating order), the
median step time per variant -> tokens/s. Memory: each variant again in a fresh subprocess: peak
RSS (VmHWM; ru_maxrss would carry the parent's RSS across fork + exec) minus the RSS once torch,
deepspeed, transformers and megatron are imported = what the model, optimizer, activations, data
and runtime buffers add (tracemalloc cannot see torch's allocations). Profile: cProfile over our bf16 step and
the autocast step, self time grouped by where the code lives. Roofline: per precision, the step's matrix products
(each layer's QKV, projection and two MLP GEMMs, the attention's score and context batched products, the LM head;
each with its two backward products) timed alone at the model's own shapes on this CPU: their sum is the step a
perfect engine would take if nothing but GEMMs cost time; ``fraction_of_roofline`` is that over each variant's
measured step. Prints ONE JSON line.

    python -m benchmarks.bench_train_vs_transformers --output benchmarks/results/train_vs_transformers_2026-11-29.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import time

import torch  # noqa: E402

from benchmarks import _common  # first: sets DS_ACCELERATOR before deepspeed is imported
from benchmarks._common import emit, machine, tiny_argv, tiny_corpus

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, micro_batch_size=8,
             global_batch_size=8)
OPTIM = dict(lr=1e-4, weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
# (ours, theirs): the comparisons, each at the same precision; eager against eager, compiled against compiled.
PAIRS = (("ours_bf16", "hf_autocast_bf16"), ("ours_bf16", "hf_bf16"), ("ours_bf16_unfused", "hf_autocast_bf16"),
         ("ours_fp32", "hf_fp32"),
         ("ours_model_autocast_bf16", "hf_autocast_bf16"), ("ours_bf16_compiled", "hf_autocast_bf16_compiled"),
         ("ours_fp32_compiled", "hf_fp32_compiled"))
VARIANTS = ("ours_bf16", "hf_autocast_bf16", "hf_bf16", "ours_model_autocast_bf16", "ours_bf16_unfused", "ours_fp32",
            "hf_fp32", "ours_bf16_compiled", "hf_autocast_bf16_compiled", "ours_fp32_compiled", "hf_fp32_compiled")
HF_MODES = {"hf_autocast_bf16": "autocast", "hf_bf16": "bf16", "hf_fp32": "fp32"}


def precision_of(variant: str) -> str:
    return "fp32" if "fp32" in variant else "bf16"


def run_argv(corpus: dict, bf16: bool, compiled: bool = False, attention_backend: str = "auto") -> list[str]:
    argv = tiny_argv(corpus, train_iters=1000, lr_warmup_iters=0, lr_decay_style="constant", min_lr=0.0,
                     attention_backend=attention_backend, **MODEL, **OPTIM)
    return argv + (["--bf16"] if bf16 else []) + (["--torch-compile"] if compiled else [])


def variant_argv(corpus: dict, variant: str) -> list[str]:
    """The flags of one of our engine variants (ours_<precision>[_unfused][_compiled])."""
    return run_argv(corpus, precision_of(variant) == "bf16", compiled=variant.endswith("_compiled"),
                    attention_backend="unfused" if "_unfused" in variant else "auto")


class Ours:
    """Our engine, built exactly as megatron.training.pretrain builds it (no training loop around it)."""

    def __init__(self, argv: list[str], backend: str = "gloo"):
        from megatron.arguments import run_config_from_argv
        from megatron.engine.initialize import build_engine, init_deepspeed_comm
        from megatron.parallel.state import ParallelState
        from megatron.training.data_iterators import build_datasets, micro_batch_iterator
        from megatron.training.distributed import init_process_group
        from megatron.training.pretrain import set_seeds

        rc = self.rc = run_config_from_argv(argv, world_size=1)
        init_process_group(backend)
        init_deepspeed_comm(backend)
        state = ParallelState.create(1, 1)
        tracker = set_seeds(rc.training.seed, state)
        self.engine = build_engine(rc, state, tracker=tracker)
        self.engine.train()
        self.datasets = build_datasets(rc)
        self.iterator_factory = lambda: micro_batch_iterator(self.datasets.train, rc, consumed_samples=0, dp_rank=0,
                                                             dp_size=1, num_workers=0)

    def gpt_state_dict(self) -> dict:
        """The pipeline module's weights under GPTModel's names (what megatron.checkpoint.hf.bloom maps)."""
        from megatron.model.layout import model_name

        return {model_name(name, self.rc.model): tensor for name, tensor in self.engine.module.state_dict().items()}

    def step(self, batches) -> float:
        loss = self.engine.train_batch(iter(batches))
        value = float(loss.item())
        self.engine.get_global_grad_norm()  # the training loop reads it every iteration
        return value


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """The same AdamW, parameter groups (no decay on biases and norms) and settings as our engine's."""
    from megatron.config import OptimizerConfig
    from megatron.engine.optimizer import build_client_optimizer

    return build_client_optimizer(model, OptimizerConfig(optimizer="adam", **OPTIM))


class HF:
    """A plain training loop over transformers' BloomForCausalLM."""

    def __init__(self, cfg, mode: str, gpt_state: dict | None = None, compiled: bool = False):
        """cfg: our ModelConfig; gpt_state: our weights under GPTModel names (None: random init);
        compiled: torch.compile the whole model (``nn.Module.compile``; the loss and optimizer stay eager)."""
        from transformers import BloomConfig, BloomForCausalLM

        from megatron.checkpoint.hf.bloom import bloom_config_kwargs, ours_to_bloom_state_dict

        kwargs = bloom_config_kwargs(cfg, vocab_size=cfg.padded_vocab_size)
        self.model = BloomForCausalLM(BloomConfig(**kwargs))
        if gpt_state is not None:
            state = {k: v.float() for k, v in ours_to_bloom_state_dict(gpt_state, cfg).items()}
            self.model.load_state_dict(state, strict=True)
        self.mode = mode
        if mode == "bf16":
            self.model.to(torch.bfloat16)
        self.model.train()
        self.optimizer = _adamw(self.model)
        if compiled:
            self.model.compile()

    def step(self, batches) -> float:
        (tokens, _), (labels, loss_mask) = batches[0]  # one micro-batch per step here
        self.optimizer.zero_grad(set_to_none=True)
        if self.mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = self.model(input_ids=tokens).logits  # [b, s, v]
        else:
            logits = self.model(input_ids=tokens).logits  # [b, s, v]
        per_token = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                      reduction="none")  # [b * s]
        mask = loss_mask.flatten().float()
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPTIM["clip_grad"])
        self.optimizer.step()
        return float(loss.item())


class OursPlain(HF):
    """Our GPTModel (megatron.model, no DeepSpeed, no pipeline) in HF's loop under autocast: the
    model code's speed alone, to separate it from the engine's (DeepSpeed + BF16_Optimizer)."""

    def __init__(self, cfg, gpt_state: dict):
        import dataclasses

        from megatron.model import GPTModel

        self.model = GPTModel(dataclasses.replace(cfg, params_dtype="fp32"))
        self.model.load_state_dict({k: v.float() for k, v in gpt_state.items()}, strict=True)
        self.mode = "autocast"
        self.model.train()
        self.optimizer = _adamw(self.model)

    def step(self, batches) -> float:
        (tokens, position_ids), (labels, loss_mask) = batches[0]
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(tokens, position_ids, labels=labels, loss_mask=loss_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPTIM["clip_grad"])
        self.optimizer.step()
        return float(loss.item())


def build(corpus: dict, variants) -> dict:
    """One runner per variant. Every variant starts from the same weights: the compiled engines are built
    with the same seed as the eager ones (same initialization), the transformers models load the eager
    engine's weights of their precision before any of them trains."""
    runners = {}
    for v in variants:
        if v.startswith("ours_") and v != "ours_model_autocast_bf16":
            runners[v] = Ours(variant_argv(corpus, v))
    for v in variants:
        if v == "ours_model_autocast_bf16":
            source = runners["ours_bf16"]
            runners[v] = OursPlain(source.rc.model, source.gpt_state_dict())
        elif v.startswith("hf_"):
            source = runners[f"ours_{precision_of(v)}"]
            mode = HF_MODES[v.removesuffix("_compiled")]
            runners[v] = HF(source.rc.model, mode, source.gpt_state_dict(), compiled=v.endswith("_compiled"))
    return runners


def best_ratios(speed: dict) -> dict:
    """Per precision, our fastest engine variant against transformers' fastest (the plain-loop GPTModel
    variant is not an engine and is left out)."""
    out = {}
    for precision in ("bf16", "fp32"):
        fastest = {side: min((v for v in speed if v.startswith(side) and precision_of(v) == precision
                              and "model" not in v), key=lambda v: speed[v]["median_step_s"])
                   for side in ("ours_", "hf_")}
        out[f"best_{precision}: {fastest['ours_']}_vs_{fastest['hf_']}"] = (
            speed[fastest["hf_"]]["median_step_s"] / speed[fastest["ours_"]]["median_step_s"])
    return out


def gemm_shapes(vocab_rows: int) -> dict:
    """{name: (count per step, batch, m, k, n)}: every matrix product of one forward of the model (``MODEL``) as a
    [batch] x [m, k] x [k, n] product; each also runs twice in backward (the input and the weight gradient, the same
    FLOPs). The attention's products are causal in effect but computed whole by every CPU path here."""
    h, layers, s = MODEL["hidden_size"], MODEL["num_layers"], MODEL["seq_length"]
    tokens, heads = MODEL["micro_batch_size"] * s, MODEL["num_attention_heads"]
    return {"qkv": (layers, 1, tokens, h, 3 * h), "attention_projection": (layers, 1, tokens, h, h),
            "mlp_fc1": (layers, 1, tokens, h, 4 * h), "mlp_fc2": (layers, 1, tokens, 4 * h, h),
            "attention_scores": (layers, MODEL["micro_batch_size"] * heads, s, h // heads, s),
            "attention_context": (layers, MODEL["micro_batch_size"] * heads, s, s, h // heads),
            "lm_head": (1, 1, tokens, h, vocab_rows)}


def layer_gemm_roofline(dtype: torch.dtype, vocab_rows: int, reps: int = 20) -> dict:
    """The step's GEMM FLOPs over this CPU's measured rate at the model's own shapes: per shape, the median time of
    its forward product and its two backward products (dX = dY W^T, dW = X^T dY), each alone."""
    shapes, total_s, total_flop = {}, 0.0, 0.0
    for name, (count, batch, m, k, n) in gemm_shapes(vocab_rows).items():
        x, w, dy = (torch.randn(batch, *shape, dtype=dtype) for shape in ((m, k), (k, n), (m, n)))
        products = (lambda: torch.bmm(x, w), lambda: torch.bmm(dy, w.transpose(1, 2)),
                    lambda: torch.bmm(x.transpose(1, 2), dy))
        seconds = 0.0
        for product in products:
            for _ in range(3):
                product()
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                product()
                times.append(time.perf_counter() - t)
            seconds += statistics.median(times)
        flop = 3 * 2 * batch * m * k * n
        shapes[name] = {"per_step": count, "shape": [batch, m, k, n], "fwd_bwd_s": seconds,
                        "gflops": flop / seconds / 1e9}
        total_s, total_flop = total_s + count * seconds, total_flop + count * flop
    return {"gemm_step_s": total_s, "step_gflop": total_flop / 1e9, "gflops_at_layer_shapes": total_flop / total_s / 1e9,
            "shapes": shapes}


def take_batches(runner, n: int) -> list:
    it = runner.iterator_factory()
    return [[next(it)] for _ in range(n)]


def profile_step(runner, batches, steps: int) -> dict:
    """cProfile self time of ``steps`` steps, grouped by where the code lives."""
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        runner.step(batches[i % len(batches)])
    prof.disable()
    stats = pstats.Stats(prof)
    groups: dict = {}
    top = []
    for (file, line, func), (_, ncalls, tottime, _, _) in stats.stats.items():
        if file == "~":
            key = "torch ops / C builtins" if ("torch" in func or "method" in func) else "other builtins"
        elif "/deepspeed/" in file:
            key = "deepspeed (python)"
        elif "/megatron/" in file:
            key = "megatron (python)"
        elif "/transformers/" in file:
            key = "transformers (python)"
        elif "/torch/" in file:
            key = "torch (python)"
        else:
            key = "other python"
        groups[key] = groups.get(key, 0.0) + tottime
        top.append((tottime, ncalls, f"{os.path.relpath(file) if file != '~' else ''}:{line}:{func}"))
    top.sort(reverse=True)
    total = sum(groups.values())
    # Cumulative time of the phases of a step: DeepSpeed's pipeline instructions, BF16_Optimizer's
    # parts, the model's forward, transformers' forward.
    phases = {}
    for (file, line, func), (_, _, _, cumtime, _) in stats.stats.items():
        if ("pipe/engine.py" in file and func.startswith("_exec_")) or "bf16_optimizer.py" in file or \
                func in ("clip_tensors_by_global_norm", "get_global_norm_of_tensors", "get_global_norm") or \
                (func == "forward" and ("megatron/model" in file or "modeling_bloom" in file)) or \
                func in ("train_batch", "step", "backward", "clip_grad_norm_", "_aggregate_total_loss"):
            key = f"{os.path.basename(file)}:{func}"
            phases[key] = max(phases.get(key, 0.0), cumtime)
    phases = dict(sorted(((k, round(v / steps, 4)) for k, v in phases.items() if v / steps > 0.002),
                         key=lambda kv: -kv[1])[:20])
    return {"steps": steps, "total_s": total, "self_time_s_by_area": {k: round(v, 4) for k, v in groups.items()},
            "cumulative_s_per_step": phases,
            "top_self_time": [{"s": round(t, 4), "calls": n, "where": w} for t, n, w in top[:12]]}


def random_batches(cfg, n: int, batch: int, vocab: int = 400) -> list:
    """Micro-batches shaped like our iterator's: ((tokens, position_ids), (labels, loss_mask))."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, cfg.seq_length + 1), generator=g)
        pos = torch.arange(cfg.seq_length).expand(batch, -1)
        out.append([((tokens[:, :-1], pos), (tokens[:, 1:], torch.ones(batch, cfg.seq_length)))])
    return out


def memory_child(variant: str, corpus_dir: str) -> None:
    """Peak RSS of one variant alone in this fresh process, above the RSS once everything is imported."""
    import deepspeed  # noqa: F401  (imported before the baseline: library code is not the variant's memory)
    import psutil
    import transformers  # noqa: F401

    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain  # noqa: F401

    corpus = tiny_corpus(corpus_dir)
    base_rss = psutil.Process().memory_info().rss
    bf16 = precision_of(variant) == "bf16"
    compiled = variant.endswith("_compiled")
    if variant.startswith("ours"):
        runner = Ours(variant_argv(corpus, variant))
        batches = take_batches(runner, 3)
    else:
        rc = run_config_from_argv(run_argv(corpus, bf16), world_size=1)
        runner = HF(rc.model, HF_MODES[variant.removesuffix("_compiled")], compiled=compiled)
        batches = random_batches(rc.model, 3, MODEL["micro_batch_size"])
    for b in batches:
        runner.step(b)
    # VmHWM, not ru_maxrss: Linux carries the parent's RSS at fork into ru_maxrss across exec.
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"variant": variant, "rss_after_imports": base_rss, "peak_rss_vmhwm": peak,
                      "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "peak_minus_imports_mb": (peak - base_rss) / 2 ** 20}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    p.add_argument("--loss-steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps-per-rep", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: steadier on a shared machine; both sides get the same)")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    p.add_argument("--corpus-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args.memory_child, args.corpus_dir)

    before = machine()
    corpus = tiny_corpus()
    runners = build(corpus, VARIANTS)
    batches = take_batches(runners["ours_bf16"], max(args.loss_steps, args.steps_per_rep * args.reps) + 2)

    # Losses from identical weights on identical batches (ours_* trains first: HF copied its start).
    losses = {v: [r.step(batches[i]) for i in range(args.loss_steps)] for v, r in runners.items()}
    curves = {}
    for ours, theirs in PAIRS + (("ours_bf16_compiled", "ours_bf16"), ("ours_fp32_compiled", "ours_fp32"),
                                 ("ours_bf16_unfused", "ours_bf16")):
        rel = [abs(a - b) / abs(b) for a, b in zip(losses[ours], losses[theirs])]
        curves[f"{ours}_vs_{theirs}"] = {"max_rel_diff": max(rel), "mean_rel_diff": sum(rel) / len(rel)}

    # Warm-up (bf16 kernels are slow the first times), then alternating timed repetitions.
    for r in runners.values():
        r.step(batches[0])
    times = {v: [] for v in runners}
    order = list(runners)
    for rep in range(args.reps):
        rotated = order[rep % len(order):] + order[:rep % len(order)]
        for v in rotated:
            t = time.perf_counter()
            for i in range(args.steps_per_rep):
                runners[v].step(batches[(rep * args.steps_per_rep + i) % len(batches)])
            times[v].append((time.perf_counter() - t) / args.steps_per_rep)
    tokens = MODEL["global_batch_size"] * MODEL["seq_length"]
    speed = {v: {"median_step_s": statistics.median(ts), "tokens_per_s": tokens / statistics.median(ts),
                 "step_s_all_reps": ts} for v, ts in times.items()}
    ratios = {f"{o}_vs_{v}": speed[v]["median_step_s"] / speed[o]["median_step_s"] for o, v in PAIRS}
    ratios.update(best_ratios(speed))
    vocab_rows = runners["ours_bf16"].rc.model.padded_vocab_size
    roofline = {precision: layer_gemm_roofline(dtype, vocab_rows)
                for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    fraction_of_roofline = {v: roofline[precision_of(v)]["gemm_step_s"] / speed[v]["median_step_s"] for v in speed}

    profiles = {v: profile_step(runners[v], batches, args.profile_steps)
                for v in ("ours_bf16", "hf_autocast_bf16", "ours_model_autocast_bf16", "ours_bf16_unfused",
                          "ours_bf16_compiled", "hf_autocast_bf16_compiled")}

    memory = {}
    # a fresh single-process group in each child: drop the rendezvous this process set up
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    child_env["DS_ACCELERATOR"] = "cpu"
    if not args.no_memory:
        for v in [v for v in VARIANTS if v != "ours_model_autocast_bf16"]:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_train_vs_transformers", "--memory-child", v,
                                   "--threads", str(args.threads), "--corpus-dir",
                                   os.path.dirname(corpus["data_prefix"])], capture_output=True, text=True,
                                  timeout=600, env=child_env, cwd=_common.REPO)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            memory[v] = json.loads(lines[-1]) if lines else {"error": proc.stderr[-1500:]}

    emit({"benchmark": "train_vs_transformers",
          "config": dict(MODEL, **OPTIM, vocab_rows=runners["ours_bf16"].rc.model.padded_vocab_size, dropout=0.0,
                         threads=torch.get_num_threads(), loss_steps=args.loss_steps, reps=args.reps,
                         steps_per_rep=args.steps_per_rep, one_process=True),
          "compared_with": "transformers BloomForCausalLM, plain loop (AdamW foreach, clip_grad_norm_), same weights "
                           "and batches, alternating repetitions in the same process",
          "goal": "ours >= 1.3x hf tokens/s in bf16 and fp32 at equal loss curve, also against torch.compile'd hf",
          "speedup_ours_over_hf": ratios, "speed": speed, "roofline": roofline,
          "fraction_of_roofline": fraction_of_roofline, "losses": losses, "loss_curves": curves,
          "profile": profiles, "memory": memory, "machine": before}, args.output)


if __name__ == "__main__":
    main()

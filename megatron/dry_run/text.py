"""The dry run's report as text: one block per section, numbers with thousands separators, then the
warnings, what could not be checked, the problems (one ``error:`` line each) and the verdict."""

from __future__ import annotations


def _n(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


def _span(pair) -> str:
    return "-" if pair is None else (f"{pair[0]}" if pair[0] == pair[1] else f"{pair[0]}-{pair[1]}")


def render(report: dict) -> str:
    world = report["world_size"]
    lines = ["pretrain_gpt.py --dry-run: the job checked without starting it",
             f"world size   {world['value'] if world['value'] is not None else 'unknown'} (from {world['source']})"]
    for key, section in (("model", _model), ("layout", _layout), ("batch", _batch), ("run", _run),
                         ("lr_schedule", _lr), ("memory", _memory), ("step", _step), ("schedule", _schedule),
                         ("experts", _experts), ("context_parallel", _context_parallel), ("fp8", _fp8)):
        if report[key] is not None:  # None: not computed (the report's "not_checked" says why)
            lines += section(report[key])
    for title, key, prefix in (("warnings (logged at startup, or about the estimates)", "warnings", ""),
                               ("problems", "problems", "error: "), ("not checked", "not_checked", "")):
        if report[key]:
            lines += ["", f"{title}:"] + [f"  {prefix}{line}" for line in report[key]]
    n = len(report["problems"])
    lines += ["", "dry run: OK, the job would start" if report["ok"] else
              f"dry run: {n} problem{'s' if n != 1 else ''}, the job would not start"]
    return "\n".join(lines)


def _model(m: dict) -> list[str]:
    vocab = ("vocabulary unknown (no tokenizer)" if m["padded_vocab_size"] is None else
             f"vocabulary {_n(m['original_vocab_size'])} -> {_n(m['padded_vocab_size'])} rows (padded)")
    zero = (f"ZeRO stage {m['zero_stage']}" if m["zero_stage"] == m["deepspeed_zero_stage"] else
            f"ZeRO stage {m['zero_stage']} (runs as {m['deepspeed_zero_stage']})")
    heads = f"{m['num_attention_heads']} heads"
    mla = m.get("mla")
    if mla is not None:  # multi-head latent attention: its own head sizes (--kv-channels does not apply)
        query = "" if mla["q_lora_rank"] is None else f"query latent {mla['q_lora_rank']}, "
        heads += (f" of latent attention ({query}key / value latent {mla['kv_lora_rank']}, query / key "
                  f"{mla['qk_head_dim']} + {mla['qk_pos_emb_head_dim']} rotary, value {mla['v_head_dim']})")
    elif m.get("head_dim") not in (None, m["hidden_size"] // m["num_attention_heads"]):
        heads += f" of {m['head_dim']} (--kv-channels)"
    if m["num_key_value_heads"] != m["num_attention_heads"]:
        heads += f" ({m['num_key_value_heads']} key / value)"
    block = ", ".join([m["normalization"], "SwiGLU" if m["swiglu"] else "GeLU",
                       "biases" if m["add_bias_linear"] else "q/k/v biases only" if m["add_qkv_bias"] else "no biases",
                       "tied head" if m["tied_embeddings"] else "untied head"])
    params = "" if m["num_parameters"] is None else f"{m['num_parameters'] / 1e9:.2f}B parameters; "
    position = m["position_embedding_type"] + (f" ({m['rope_scaling']})" if m.get("rope_scaling") else "")
    if m.get("mtp_num_layers"):  # multi-token prediction: its depths after the decoder's layers
        block += f", {m['mtp_num_layers']} MTP depth(s) weighted {m['mtp_loss_scaling_factor']:g}"
    return [f"model        {m['num_layers']} layers, hidden {m['hidden_size']}, {heads}, "
            f"ffn {m['ffn_hidden_size']}, seq {m['seq_length']}, {position}, {block}, "
            f"{m['params_dtype']}, {zero}; {params}{vocab}"]


def _layout(lay: dict) -> list[str]:
    sp = " (sequence parallel)" if lay.get("sequence_parallel") else ""
    ulysses = lay.get("ds_sequence_parallel_size", 1)
    ulysses = f" x Ulysses SP {ulysses}" if ulysses > 1 else ""
    cp = lay.get("context_parallel_size", 1)
    ulysses += f" x CP {cp} (ring attention)" if cp > 1 else ""
    lines = ["", f"layout       TP {lay['tensor_model_parallel_size']}{sp} x PP {lay['pipeline_model_parallel_size']} x "
             f"DP {lay['data_parallel_size']}{ulysses} = {lay['world_size']} ranks; {lay['num_pipeline_items']} "
             f"pipeline items split by --pp-partition-method {lay['pp_partition_method']} (DeepSpeed's rule)"]
    if lay.get("pipeline_layout"):
        lines[-1] = lines[-1].replace("split by --pp-partition-method " + lay["pp_partition_method"] + " (DeepSpeed's rule)",
                                      "placed by the pipeline layout flags")
        lines.append(f"  layout     {' | '.join(lay['pipeline_layout'])}")
    for s in lay["stages"]:
        extra = f"  + {', '.join(s['holds'])}" if s["holds"] else ""
        lines.append(f"  stage {s['stage']:>2}  ranks {_span(s['ranks']):>9}  items {_span(s['items']):>7}  "
                     f"transformer layers {_span(s['transformer_layers']):>7} ({s['num_transformer_layers']}){extra}")
        for c in s.get("chunks", ()):
            extra = f"  + {', '.join(c['holds'])}" if c["holds"] else ""
            lines.append(f"    virtual stage {c['virtual_stage']:>3}  items {_span(c['items']):>7}  transformer layers "
                         f"{_span(c['transformer_layers']):>7} ({c['num_transformer_layers']}){extra}")
    return lines


def _batch(b: dict) -> list[str]:
    lines = ["", f"batch        micro-batch {b['micro_batch_size']} x DP {b['data_parallel_size']} = "
             f"{b['samples_per_micro_step']} samples per micro-step; global batch {_n(b['global_batch_size'])} = "
             f"{b['num_micro_batches']} micro-batches per step"]
    r = b["rampup"]
    if r is not None:
        lines += [f"  rampup     {r['start']} -> {_n(b['global_batch_size'])} by {r['increment']}: "
                  f"{r['num_increments']} increments, one every {_n(r['samples_per_increment'])} samples; "
                  f"starts at {r['start_num_micro_batches']} micro-batches per step",
                  f"             the full batch from iteration {_n(r['full_batch_iteration'])} (after "
                  f"{_n(r['full_batch_consumed_samples'])} samples)"]
    return lines


def _run(r: dict) -> list[str]:
    asked = (f"{_n(r['train_samples'])} samples (--train-samples)" if r["train_samples"] is not None else
             f"{_n(r['train_iters'])} iterations (--train-iters)")
    return [f"run          {asked}: {_n(r['iterations'])} iterations ({_n(r['rampup_iterations'])} in the rampup), "
            f"{_n(r['consumed_samples'])} samples x {r['seq_length']} = {r['tokens'] / 1e9:,.2f}B tokens"]


def _lr(s: dict) -> list[str]:
    lines = [f"lr           {s['decay_style']}: 0 -> {s['lr']:g} over the warmup, then to {s['min_lr']:g} "
             "(counted in samples)"]
    for p in s["points"]:
        lines.append(f"  {p['point']:<16} after {_n(int(p['samples'])):>13} samples  iteration "
                     f"{_n(p['iteration']):>9}  lr {p['lr']:.4g}")
    return lines


def _memory(m: dict) -> list[str]:
    peak = m["per_stage_gib"][m["peak_stage"]]
    parts = ", ".join(f"{k} {v:g}" for k, v in peak.items())
    seq = f", sequence split {m['sequence']}" if m["sequence"] else ""
    scores = "attention scores kept" if m["attention_scores_stored"] else "fused attention (no scores kept)"
    if m.get("recompute_modules"):
        scores += f", recomputed: {' '.join(m['recompute_modules'])}"
    return ["", f"memory       planner estimate per GPU, {m['gpu']} assumed ({m['gpu_memory_gib']} GiB; "
            f"--dry-run-gpu), limit {m['limit_gib']} GiB ({m['headroom']:.0%}){seq}, {scores}",
            f"  busiest    stage {m['peak_stage']}: {m['peak_gib']} GiB ({parts} GiB) -> "
            f"{'fits' if m['fits'] else 'DOES NOT FIT'}",
            "  per stage  " + " ".join(f"{sum(stage.values()):.1f}" for stage in m["per_stage_gib"]) + " GiB"]


def _step(s: dict) -> list[str]:
    return [f"step time    planner estimate, {s['gpu']} on {s['cluster']} (--dry-run-cluster): {s['step_s']:.2f} s "
            f"per step at the full batch, bubble {s['bubble_fraction']:.1%}, {s['model_tflops_per_gpu']} model "
            f"TFLOP/s per GPU (MFU {s['mfu']:.1%}), {_n(s['tokens_per_s'])} tokens/s; the whole run "
            f"about {s['run_days']:.1f} days"]


def _fp8(f: dict) -> list[str]:
    def layers(runs) -> str:
        return ", ".join(_span(run) for run in runs) or "none"

    dtypes = f"{f['forward_dtype']} forward, {f['grad_dtype']} output gradients"
    recipe = f["recipe"]
    if recipe == "delayed":
        recipe += (f" (amax history {f['amax_history_len']}, {f['amax_compute_algo']}, margin {f['margin']})")
    wgrad = "" if f["wgrad"] else "; weight gradients in bf16 (--no-fp8-wgrad)"
    stages = " ".join(f"{s['transient_mib']:g}" for s in f["stages"])
    state = " ".join(f"{s['scaling_state_mib']:g}" for s in f["stages"])
    return ["", f"fp8          --fp8-format {f['format']} ({dtypes}), recipe {recipe}{wgrad}",
            f"  in FP8     layers {layers(f['fp8_layers'])}: {f['in_fp8']}",
            f"  in bf16    {'layers ' + layers(f['bf16_layers']) + ' whole' if f['bf16_layers'] else 'no whole layer'}; "
            f"in every layer: {f['in_bf16']}",
            f"  planner    FP8 GEMMs at {f['peak_fp8_tflops']:g} TFLOP/s peak on the {f['gpu']}, the rest at bf16's "
            f"{f['peak_bf16_tflops']:g}; MFU above is against the bf16 peak; no FP8 weight copy kept: transient "
            f"quantized weight {stages} MiB, scaling state {state} MiB per stage"]


def _schedule(s: dict) -> list[str]:
    def gib(values) -> str:
        return " ".join(f"{v:.2f}" for v in values)

    lines = [f"schedule     {s['label']}, {s['num_micro_batches']} micro-batches per step: bubble "
             f"{s['bubble_fraction']:.1%} of the step (1F1B {s['bubble_fraction_1f1b']:.1%}); p2p "
             f"{s['p2p_gib_per_rank']:g} GiB per rank and step ({s['p2p_gib_pipeline']:g} GiB through the pipeline)",
             f"  in flight  {' '.join(f'{n:g}' for n in s['in_flight_micro_batches'])} micro-batches per stage"
             + (f"; W passes waiting up to {' '.join(str(n) for n in s['deferred_weight_passes'])}"
                if any(s["deferred_weight_passes"]) else ""),
             f"  activations per stage {gib(s['activation_gib'])} GiB (1F1B {gib(s['activation_gib_1f1b'])})"]
    return lines


def _experts(e: dict) -> list[str]:
    routing = "dropless, balanced" if e["dropless"] else "capacity-bounded"
    lines = ["", f"experts      {e['num_experts']} per MoE layer, top-{e['topk']}; EP {e['expert_model_parallel_size']}: "
             f"{e['experts_per_rank']} per rank, optimizer state over {e['expert_data_parallel_size']} "
             f"expert-data-parallel rank(s); all-to-all per step ({routing})"]
    for i, stage in enumerate(e["stages"]):
        lines.append(f"  stage {i:<4} {stage['moe_layers']} MoE layers, {_n(stage['expert_params_per_rank'])} expert "
                     f"parameters per rank, {stage['all_to_all_calls']} all-to-alls, {stage['all_to_all_gib']:g} GiB "
                     f"handed ({stage['cross_rank_gib']:g} GiB cross-rank)")
    return lines


def _context_parallel(c: dict) -> list[str]:
    layer = c["per_layer_mib"]
    lines = ["", f"ring         CP {c['context_parallel_size']}: {_n(c['tokens_per_rank'])} tokens per rank; K / V "
             f"sent per layer and micro-batch {layer['forward']:g} MiB forward, {layer['backward']:g} MiB backward "
             f"(with dK / dV), {layer['recomputed_forward']:g} MiB recomputed; buffers {c['ring_buffers_mib']:g} MiB; "
             f"{c['bandwidth_gbps']:g} GB/s",
             f"  overlap    {c['overlap']}"]
    for i, stage in enumerate(c["stages"]):
        lines.append(f"  stage {i:<4} {stage['layers']} layers, {_n(stage['sends'])} sends, {stage['p2p_gib']:g} GiB "
                     f"per step, {stage['exposed_s']:g} s not hidden")
    return lines

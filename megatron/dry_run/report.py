"""``dry_run(argv)``: check a job, print its plan, write it as JSON, return the exit status.

The report is one dict (``build_report``), printed as text (``megatron.dry_run.text``) and written
as JSON with ``--dry-run-json FILE``. Exit status 0 when the job would start, 1 when any problem
was found (all of them are listed, one line each).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Mapping, Optional, Sequence

from megatron.arguments.check import ArgvCheck, check_argv
from megatron.dry_run.estimate import (
    context_parallel_section,
    experts_section,
    fp8_problem,
    fp8_section,
    hardware,
    item_param_counts,
    memory_section,
    model_shape,
    schedule_section,
    step_section,
    vocabulary_rows,
)
from megatron.dry_run.plan import RunSteps, batch_section, layout_section, lr_section, run_section
from megatron.dry_run.text import render

SECTIONS = ("layout", "batch", "run", "lr_schedule", "memory", "step", "schedule", "experts", "context_parallel",
            "fp8")


def dry_run(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, out=None) -> int:
    """pretrain_gpt.py --dry-run: print the report of ``argv`` to ``out`` (stdout); 0 if the job would start."""
    report = build_report(argv, env)
    print(render(report), file=out or sys.stdout, flush=True)
    return 0 if report["ok"] else 1


def build_report(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> dict:
    """The checked job as a JSON-ready dict; written to --dry-run-json FILE when that is given."""
    check = check_argv(argv, env)
    report = {"ok": False, "argv": list(argv),
              "world_size": {"value": check.world_size, "source": check.world_size_source},
              "problems": check.problems, "not_checked": check.not_checked, "warnings": list(check.warnings),
              "model": None, **{name: None for name in SECTIONS}}
    options = check.dry_run_options
    gpu = cluster = None
    if options is not None:
        try:
            fp8 = check.run_config is not None and check.run_config.model.fp8 is not None
            gpu, cluster = hardware(options.dry_run_gpu, options.dry_run_cluster, fp8)
        except ValueError as error:
            check.problems.append(str(error))
    if check.run_config is not None and gpu is not None:
        problem = fp8_problem(check.run_config, gpu)  # --fp8-format on a GPU without FP8 tensor cores
        if problem:
            check.problems.append(problem)
    if check.run_config is None:
        check.not_checked.append("the plan (pipeline stages, batch and rampup, run length, learning-rate schedule, "
                                 "memory and step time): it needs every setting valid")
    else:
        _add_plan(report, check, gpu, cluster)
    report["ok"] = check.ok
    if options is not None and options.dry_run_json:
        with open(options.dry_run_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return report


def _rope_scaling(m) -> Optional[str]:
    """The rotary scaling in words (it costs nothing: the same products), or None."""
    if m.yarn_rotary_scaling_factor not in (None, 1.0):
        return f"YaRN x{m.yarn_rotary_scaling_factor:g} of {m.yarn_original_max_position_embeddings} positions"
    if m.rope_scaling_factor is not None:
        return f"Llama 3.1 scaling x{m.rope_scaling_factor:g}"
    return None


def _add_plan(report: dict, check: ArgvCheck, gpu, cluster) -> None:
    rc = check.run_config
    m = rc.model
    report["model"] = {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
                       "num_attention_heads": m.num_attention_heads, "head_dim": m.head_dim, "ffn_hidden_size": m.ffn_size,
                       "seq_length": m.seq_length, "position_embedding_type": m.position_embedding_type,
                       "rope_scaling": _rope_scaling(m),
                       "params_dtype": m.params_dtype, "original_vocab_size": m.original_vocab_size,
                       "padded_vocab_size": m.padded_vocab_size, "zero_stage": rc.precision.zero_stage,
                       "deepspeed_zero_stage": rc.deepspeed_zero_stage, "num_key_value_heads": m.num_kv_heads,
                       "normalization": m.normalization, "swiglu": m.swiglu, "add_bias_linear": m.add_bias_linear,
                       "add_qkv_bias": m.qkv_bias, "tied_embeddings": m.tied_embeddings,
                       "num_parameters": model_shape(rc).total_params() if vocabulary_rows(rc) else None,
                       "mla": None if m.mla is None else dataclasses.asdict(m.mla),
                       "mtp_num_layers": m.mtp_num_layers, "mtp_loss_scaling_factor": m.mtp_loss_scaling_factor}
    steps = RunSteps(rc)
    report["batch"], report["run"], report["lr_schedule"] = (batch_section(rc, steps), run_section(rc, steps),
                                                             lr_section(rc, steps))
    try:
        counts = item_param_counts(rc) if rc.parallel.pp_partition_method == "parameters" else None
        report["layout"] = layout_section(rc, counts)
    except ValueError as error:
        check.not_checked.append(f"the pipeline stages, memory and step time: {error}")
        return
    if gpu is None:
        check.not_checked.append("the memory and step-time estimates: no GPU to assume (see the problems)")
        return
    stage_layers = [stage["num_transformer_layers"] for stage in report["layout"]["stages"]]
    if fp8_problem(rc, gpu):
        check.not_checked.append(f"the memory and step-time estimates: FP8 does not run on the {gpu.name} (see the "
                                 "problems)")
        return
    try:
        report["memory"] = memory_section(rc, stage_layers, gpu)
        report["step"] = step_section(rc, stage_layers, gpu, cluster, steps.steps_per_batch_size())
        report["schedule"] = schedule_section(rc, stage_layers, gpu, cluster)
        report["experts"] = experts_section(rc, stage_layers)
        report["context_parallel"] = context_parallel_section(rc, stage_layers, gpu, cluster)
        report["fp8"] = fp8_section(rc, stage_layers, gpu)
    except ValueError as error:
        check.not_checked.append(f"the memory and step-time estimates: {error}")
        return
    if vocabulary_rows(rc) != m.padded_vocab_size:
        report["warnings"].append(f"the estimates take --pad-vocab-size-to {vocabulary_rows(rc)} as the vocabulary "
                                  "rows (the tokenizer was not built)")
    if not report["memory"]["fits"]:
        mem = report["memory"]
        report["warnings"].append(f"the planner's estimate for stage {mem['peak_stage']}, {mem['peak_gib']} GiB, is "
                                  f"above {mem['limit_gib']} GiB ({mem['headroom']:.0%} of the {mem['gpu']}): the job "
                                  "may run out of memory (more PP or TP, a smaller micro-batch, "
                                  "--checkpoint-activations" + _schedule_hint(report["schedule"]) + ")")


def _schedule_hint(schedule) -> str:
    """Where the run's schedule holds more activations than 1F1B would on its busiest stage, say so."""
    if schedule is None or schedule["schedule"] == "1f1b":
        return ""
    if max(schedule["activation_gib"]) <= max(schedule["activation_gib_1f1b"]):
        return ""
    return (f", or 1F1B: {schedule['label']} holds {max(schedule['activation_gib']):g} GiB of activations on its "
            f"busiest stage against 1F1B's {max(schedule['activation_gib_1f1b']):g}")

"""The one table of refused feature combinations: which two features of a run do not work together (yet), why,
and what to do instead. Pure (no torch): it reads a ``RunConfig`` and raises ``ValueError`` before any process
starts.

- ``FEATURES``: each feature's name, its flag as a user writes it, a predicate over a ``RunConfig`` (``rc``) and how
  a message names it in this run (the flag with its value).
- ``REFUSED``: every refused pair (feature a, feature b, reason, fix). Feature a's check reports it: the rule
  functions of megatron/config (``check_context_parallel_run``, ``check_moe_run``, ``check_zero_bubble_run``,
  ``check_interleaved_run``, ``RunConfig.validate``) call ``check_combinations(rc, a)`` where their own lists
  used to be, so a refusal is found in the same order as before.
- ``check_combinations(rc, owner=None)``: ValueError for the refused pairs present (of one owner, or of all). The
  refusals of a feature in ``GROUPED`` come as one message naming every partner present ("A does not work yet with
  B (why); C (why): ... fixes"); an entry with its own ``say`` comes alone, worded as before.

Rendered into docs/flags.md ("Feature combinations refused") by tools/gen_flags_doc.py, so the doc cannot drift.
Checks that are not pair-wise combinations of features (divisibility, sequence lengths, layout rules such as
"virtual stages need PP > 1", micro-batch counts, ZB-H1's fp32 ZeRO stage) stay with their own rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

__all__ = ["markdown_cell", "FEATURES", "GROUPED", "REFUSED", "Feature", "Refused", "check_combinations", "feature",
           "refusal", "refused_present", "render_markdown"]


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature a run may use: ``flag`` as a user writes it (the docs), ``present(rc)``, and ``given(rc)``: how
    a message names it in this run (the flag with its value)."""

    name: str
    flag: str
    present: Callable[[Any], bool]
    given: Callable[[Any], str]


def _model_engine_flag(rc) -> str:
    """What puts the run on DeepSpeed's model engine: ZeRO-2/3 (checked first, as before), else Ulysses."""
    stage = rc.precision.zero_stage
    sp = rc.parallel.ds_sequence_parallel_size
    return f"--zero-stage {stage}" if stage >= 2 else f"--ds-sequence-parallel-size {sp}"


FEATURES: tuple[Feature, ...] = (
    Feature("pipeline parallelism", "--pipeline-model-parallel-size N (N > 1)",
            lambda rc: rc.parallel.pipeline_model_parallel_size > 1,
            lambda rc: f"--pipeline-model-parallel-size {rc.parallel.pipeline_model_parallel_size}"),
    Feature("interleaved", "--num-virtual-stages-per-pipeline-rank V (V > 1)",
            lambda rc: rc.parallel.num_virtual_stages_per_pipeline_rank > 1,
            lambda rc: f"--num-virtual-stages-per-pipeline-rank {rc.parallel.num_virtual_stages_per_pipeline_rank}"),
    Feature("ZB-H1", "--enable-zbh1-pipeline", lambda rc: rc.parallel.enable_zbh1_pipeline,
            lambda rc: "--enable-zbh1-pipeline"),
    Feature("context parallelism", "--context-parallel-size N (N > 1)",
            lambda rc: rc.parallel.context_parallel_size > 1,
            lambda rc: f"--context-parallel-size {rc.parallel.context_parallel_size}"),
    Feature("Ulysses", "--ds-sequence-parallel-size N (N > 1)", lambda rc: rc.parallel.ds_sequence_parallel_size > 1,
            lambda rc: f"--ds-sequence-parallel-size {rc.parallel.ds_sequence_parallel_size} (DeepSpeed-Ulysses)"),
    Feature("sequence parallelism", "--sequence-parallel (with --tensor-model-parallel-size > 1)",
            lambda rc: rc.model.sequence_parallel, lambda rc: "--sequence-parallel"),
    Feature("MoE", "--num-experts N", lambda rc: rc.model.moe is not None, lambda rc: "MoE (--num-experts)"),
    Feature("expert parallelism", "--expert-model-parallel-size N (N > 1)",
            lambda rc: rc.parallel.expert_model_parallel_size > 1,
            lambda rc: f"--expert-model-parallel-size {rc.parallel.expert_model_parallel_size}"),
    Feature("MLA", "--multi-latent-attention", lambda rc: rc.model.mla is not None,
            lambda rc: "--multi-latent-attention"),
    Feature("torch.compile", "--torch-compile", lambda rc: rc.training.torch_compile, lambda rc: "--torch-compile"),
    Feature("fp16", "--fp16", lambda rc: rc.fp16, lambda rc: "--fp16"),
    Feature("ZeRO-2/3", "--zero-stage 2 or 3", lambda rc: rc.precision.zero_stage >= 2,
            lambda rc: f"--zero-stage {rc.precision.zero_stage}"),
    Feature("ZeRO-3", "--zero-stage 3", lambda rc: rc.precision.zero_stage == 3, lambda rc: "--zero-stage 3"),
    Feature("model engine", "--zero-stage 2 or 3, or --ds-sequence-parallel-size N > 1 (DeepSpeed's "
            "model engine)", lambda rc: rc.on_model_engine, _model_engine_flag),
    Feature("ZeRO++ hpZ", "--zero-hpz-partition-size N (N > 1)", lambda rc: rc.parallel.zero_hpz_partition_size > 1,
            lambda rc: f"--zero-hpz-partition-size {rc.parallel.zero_hpz_partition_size}"),
    Feature("attention dropout", "--attention-dropout P (P > 0)", lambda rc: rc.model.attention_dropout > 0,
            lambda rc: f"--attention-dropout {rc.model.attention_dropout}"),
    Feature("attention backend other than auto / sdpa", "--attention-backend flex | flash | unfused",
            lambda rc: rc.model.attention_backend not in ("auto", "sdpa"),
            lambda rc: f"--attention-backend {rc.model.attention_backend}"),
    Feature("flash attention backend", "--attention-backend flash", lambda rc: rc.model.attention_backend == "flash",
            lambda rc: "--attention-backend flash"),
    Feature("selective recomputation", "--recompute-granularity selective",
            lambda rc: rc.model.recompute_core_attention,
            lambda rc: "selective recomputation of the core attention"),
    Feature("live evaluation harness", "--eval-harness-tasks", lambda rc: bool(rc.training.eval_harness_tasks),
            lambda rc: "--eval-harness-tasks"),
    Feature("universal checkpoint", "--universal-checkpoint", lambda rc: rc.checkpoint.universal_checkpoint,
            lambda rc: "--universal-checkpoint"),
    Feature("batch-size rampup", "--rampup-batch-size", lambda rc: rc.batch.rampup_batch_size is not None,
            lambda rc: "--rampup-batch-size"),
    Feature("partition method other than type:transformer", "--pp-partition-method (not type:transformer)",
            lambda rc: rc.parallel.pp_partition_method != "type:transformer",
            lambda rc: f"--pp-partition-method {rc.parallel.pp_partition_method}"),
    Feature("DeepSpeed activation checkpointing", "--deepspeed-activation-checkpointing",
            lambda rc: rc.training.deepspeed_activation_checkpointing,
            lambda rc: "--deepspeed-activation-checkpointing"),
    Feature("sync TP-duplicated parameters", "--sync-tp-duplicated-parameters",
            lambda rc: rc.training.sync_tp_duplicated_parameters, lambda rc: "--sync-tp-duplicated-parameters"),
    Feature("Muon", "--optimizer muon", lambda rc: rc.optimizer.optimizer == "muon", lambda rc: "--optimizer muon"),
    Feature("FP8", "--fp8-format e4m3 | hybrid", lambda rc: rc.model.fp8 is not None,
            lambda rc: f"--fp8-format {rc.model.fp8.fp8_format}"),
    Feature("MTP", "--mtp-num-layers N (N > 0)", lambda rc: rc.model.mtp_num_layers > 0,
            lambda rc: f"--mtp-num-layers {rc.model.mtp_num_layers}"),
    Feature("document attention mask", "--reset-attention-mask", lambda rc: rc.data.reset_attention_mask,
            lambda rc: "--reset-attention-mask"),
)
_BY_NAME = {f.name: f for f in FEATURES}


def feature(name: str) -> Feature:
    return _BY_NAME[name]


@dataclasses.dataclass(frozen=True)
class Refused:
    """Features ``a`` and ``b`` are refused together: ``reason`` and ``fix`` (the docs' table). ``a``'s check
    reports it: as one part of ``a``'s grouped message (``GROUPED``), or, with ``say``, alone. ``say`` is a
    ``str.format`` template over ``a`` and ``b`` (the features as given), ``reason``, ``fix`` and ``rc``."""

    a: str
    b: str
    reason: str
    fix: str
    say: Optional[str] = None


# How a feature's grouped message reads (str.format over a, rc, fixes): its head, then "B (why); C (why)", then
# its closing, which names the partners' fixes.
GROUPED: dict[str, tuple[str, str]] = {
    "MLA": ("{a} is not implemented with", "; {fixes} or use the fused-QKV attention"),
    "MoE": ("MoE (--num-experts {rc.model.moe.num_experts}) does not work yet with",
            ": refused rather than run or written wrongly; {fixes}, or train a dense model"),
    "context parallelism": ("{a} does not work yet with",
                            ": refused rather than run wrongly; {fixes}, or train with --context-parallel-size 1"),
    "interleaved": ("{a} (interleaved pipeline) does not support", " yet: {fixes}, or drop the virtual stages (1F1B)"),
}

# "... this run (ZeRO stage 2, --ds-sequence-parallel-size 1) trains on DeepSpeed's model engine"
_NON_PIPELINE_RUN = ("{stage} {{rc.precision.zero_stage}}, --ds-sequence-parallel-size "
                     "{{rc.parallel.ds_sequence_parallel_size}}) trains on DeepSpeed's model engine")

REFUSED: tuple[Refused, ...] = (
    # MLA (megatron/model/latent_attention.py): the parallelisms it is not implemented with
    Refused("MLA", "flash attention backend", "FlashAttention-2's flash_attn_func needs one head size for queries, "
            "keys and values (MLA's value heads are v-head-dim, its query / key heads qk-head-dim + "
            "qk-pos-emb-head-dim); and it runs on CUDA only, untestable here",
            "use --attention-backend sdpa, flex or unfused"),
    # the ZeRO stages DeepSpeed's pipeline engine runs
    Refused("ZeRO-2/3", "pipeline parallelism", "DeepSpeed's pipeline engine shards the optimizer state only (ZeRO-1)",
            "Either keep the pipeline with --zero-stage 1 (3D parallelism, BLOOM's layout), or drop it "
            "(--pipeline-model-parallel-size 1) and shard over data parallelism with ZeRO-2 or 3 (tensor parallelism "
            "still applies)", say="{a} does not combine with {b}: {reason}. {fix}"),
    Refused("sync TP-duplicated parameters", "ZeRO-3", "each rank holds only a partition of every parameter",
            "drop it or use --zero-stage 2", say="{a} does not combine with {b} ({reason}); {fix}"),
    # DeepSpeed-Ulysses
    Refused("Ulysses", "pipeline parallelism", "DeepSpeed's pipeline engine reduces gradients over the data-parallel "
            "group only, not over the sequence-parallel ranks",
            "Use --pipeline-model-parallel-size 1 (any --zero-stage, with tensor and data parallelism), or drop "
            "--ds-sequence-parallel-size and keep the pipeline", say="{a} does not combine with {b}: {reason}. {fix}"),
    # what DeepSpeed's model engine (ZeRO-2/3, Ulysses: megatron/engine/model_engine.py) does not run here
    Refused("model engine", "DeepSpeed activation checkpointing", "it is the pipeline engine's checkpointing",
            "--checkpoint-activations alone recomputes the layers",
            say="{b} is for the pipeline engine; with {a}, {fix}"),
    Refused("model engine", "fp16", "DeepSpeed's CPU accelerator refuses fp16, so the model engine's loss-scaled "
            "ZeRO-2/3 and Ulysses path has never run here", "use --bf16 or fp32",
            say="{b} with {a} is not supported here ({reason}); {fix}"),
    # Expert parallelism x ZeRO-3: DeepSpeed's engine (the pinned version: runtime/engine.py,
    # _validate_zero3_moe_compatibility) asserts "Native DeepSpeed MoE is not supported with ZeRO Stage 3" when it
    # finds the MoE marker our EP > 1 runs add (megatron/engine/expert_parallel.py); it takes expert-parallel layers
    # under ZeRO-3 only from its AutoEP, and its stage-3 optimizer has no expert-data-parallel partitioning. At
    # EP = 1 the experts are plain parameters and ZeRO-3 shards them as any other (tests/training/test_moe_schedules.py).
    Refused("expert parallelism", "ZeRO-3", "DeepSpeed's ZeRO-3 takes expert-parallel layers only from its AutoEP "
            "(Hugging Face models: its engine asserts 'Native DeepSpeed MoE is not supported with ZeRO Stage 3'), "
            "and cannot shard our experts over their expert-data-parallel group",
            "use --zero-stage 2 (the experts' gradients and optimizer state sharded there) or 1, or "
            "--expert-model-parallel-size 1 (ZeRO-3 then shards the experts as any parameter)",
            say="MoE (--num-experts {rc.model.moe.num_experts}) with {a} does not work with {b}: {reason}; {fix}"),
    Refused("MoE", "fp16", "DeepSpeed's CPU accelerator refuses fp16, so no MoE run has trained under its loss "
            "scaler here (the router's aux loss and the expert-parallel gradient norm under a scaled loss)",
            "use --bf16"),
    # ZB-H1 (megatron/engine/schedules/zero_bubble.py)
    Refused("ZB-H1", "model engine", "ZB-H1 is a schedule of the pipeline engine",
            "Use --zero-stage 0 or 1 without Ulysses, or drop --enable-zbh1-pipeline",
            say="{a} is a schedule of the pipeline engine; this run (" + _NON_PIPELINE_RUN.format(stage="--zero-stage")
            + ". {fix}"),
    Refused("ZB-H1", "torch.compile", "a compiled layer cannot hand its weight gradient to the schedule",
            "drop one of them", say="{a} does not combine with {b} ({reason}); {fix}"),
    # context parallelism (ring attention, megatron/model/ring_attention.py)
    Refused("context parallelism", "Ulysses", "both split the sequence", "drop --ds-sequence-parallel-size"),
    Refused("context parallelism", "attention backend other than auto / sdpa", "the ring computes each block with "
            "its own fp32 kernel and merges the blocks by their log-sum-exp; the flex and unfused kernels are not "
            "built into it (flex_attention's return_lse would be the form), and flash's ring form needs CUDA and "
            "flash-attn, so it cannot run here", "use --attention-backend auto"),
    # interleaved virtual stages (megatron/engine/schedules/interleaved.py)
    Refused("interleaved", "batch-size rampup", "the micro-batch count changes during the ramp",
            "drop --rampup-batch-size"),
    Refused("interleaved", "torch.compile", "not supported by the interleaved schedule yet", "drop --torch-compile"),
    Refused("interleaved", "ZB-H1", "a schedule of its own", "drop --enable-zbh1-pipeline"),
    Refused("interleaved", "partition method other than type:transformer", "chunks must hold equal layer counts",
            "use --pp-partition-method type:transformer"),
    # Muon (megatron/engine/muon.py): it orthogonalises whole matrices, gathered from ZeRO-1/2's and BF16_Optimizer's
    # flat partitions of each parameter group
    Refused("Muon", "ZeRO-3", "ZeRO-3 holds 1/DP of every parameter in its own sub-group partitions, which "
            "megatron.engine.muon does not gather into matrices (DeepSpeed's own ZeRO-3 Muon orthogonalises without "
            "tensor parallelism and in half precision only)", "use --zero-stage 1 or 2 (the Muon momentum is "
            "sharded over DP there too)", say="{a} does not work with {b}: {reason}; {fix}"),
    Refused("Muon", "fp16", "Megatron-LM refuses it too ('emerging optimizer with fp16 is not supported'), and fp16 "
            "cannot run on the CPU accelerator to be tested", "use --bf16 (BF16_Optimizer) or fp32",
            say="{a} does not work with {b}: {reason}; {fix}"),
    Refused("Muon", "universal checkpoint", "the universal format (DeepSpeed's ds_to_universal.py and "
            "megatron.checkpoint.universal) carries Adam's exp_avg / exp_avg_sq only: the Muon momentum would be "
            "lost", "resume Muon runs from their regular checkpoints at the same layout",
            say="{a} does not work with {b}: {reason}; {fix}"),
    # FP8 GEMMs (megatron/parallel/fp8_linear.py)
    Refused("FP8", "fp16", "fp16's dynamic loss scale multiplies the output gradients FP8 quantizes (delayed scaling "
            "would quantize them with scales from before each loss-scale change), and FP8 is built and tested here "
            "with bf16 and fp32 only (DeepSpeed's CPU accelerator refuses fp16)",
            "train FP8 with --bf16 (every Megatron-LM FP8 recipe is a bf16 run)",
            say="--fp8-format with {b} is not supported: {reason}; {fix}"),
    # multi-token prediction (megatron/model/mtp.py): each depth shifts the targets one place left along the sequence
    Refused("MTP", "Ulysses", "DeepSpeed's model engine takes each rank's per-token loss over its sequence shard, "
            "and the depths' shifted losses are not built into that path (they are into the pipeline engine's, "
            "context parallelism's included)", "drop --ds-sequence-parallel-size (context parallelism on the "
            "pipeline engine splits the sequence with MTP)", say="{a} does not work yet with {b}: {reason}; {fix}"),
    # document masks (--reset-attention-mask: megatron/model/attention_core.py)
    Refused("document attention mask", "MTP", "the MTP depths' transformer layers run on shifted tokens in the "
            "loss function, which the document ids do not reach yet", "drop --mtp-num-layers",
            say="{a} does not work yet with {b}: {reason}; {fix}"),
    Refused("document attention mask", "flash attention backend", "FlashAttention-2's form for documents "
            "(flash_attn_varlen_func with cu_seqlens) needs CUDA and the flash-attn package, so it cannot be run "
            "here to test it", "use --attention-backend flex, sdpa or unfused",
            say="{a} does not work with {b}: {reason}; {fix}"),
)


def refusal(a: str, b: str) -> Refused:
    """The table's entry for features ``a`` and ``b`` (KeyError if the pair is not refused)."""
    for r in REFUSED:
        if (r.a, r.b) == (a, b):
            return r
    raise KeyError((a, b))


def refused_present(rc, owner: Optional[str] = None) -> list[Refused]:
    """The entries of ``REFUSED`` (of feature ``owner``, or all) whose two features this run has, in table order."""
    return [r for r in REFUSED if (owner is None or r.a == owner)
            and _BY_NAME[r.a].present(rc) and _BY_NAME[r.b].present(rc)]


def _message(rc, refusals: list[Refused]) -> str:
    first = refusals[0]
    a = _BY_NAME[first.a].given(rc)
    if first.say is not None:
        return first.say.format(a=a, b=_BY_NAME[first.b].given(rc), reason=first.reason, fix=first.fix, rc=rc)
    head, closing = GROUPED[first.a]
    parts = "; ".join(f"{_BY_NAME[r.b].given(rc)} ({r.reason})" for r in refusals)
    fixes = ", ".join(dict.fromkeys(r.fix for r in refusals))
    return f"{head.format(a=a, rc=rc)} {parts}{closing.format(a=a, rc=rc, fixes=fixes)}"


def check_combinations(rc, owner: Optional[str] = None) -> None:
    """ValueError for the refused pairs ``rc`` has (those of feature ``owner``, or all, owner by owner in table
    order): an entry with its own wording alone (the first), else every present partner of the owner in one
    message."""
    owners = [owner] if owner is not None else list(dict.fromkeys(r.a for r in REFUSED))
    for name in owners:
        present = refused_present(rc, name)
        alone = [r for r in present if r.say is not None]
        if alone:
            raise ValueError(_message(rc, alone[:1]))
        if present:
            raise ValueError(_message(rc, present))


def markdown_cell(text: str) -> str:
    """``text`` as one markdown table cell: whitespace folded, pipes escaped (docs/flags.md's tables)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def render_markdown() -> list[str]:
    """The docs' section: the features, then every refused pair with its reason and fix."""
    n = len(FEATURES)
    lines = ["## Feature combinations refused", "",
             f"From `megatron/config/combinations.py` (`REFUSED`), checked by `check_combinations` before any process "
             f"starts: {len(REFUSED)} of the {n * (n - 1) // 2} pairs of its {n} features are refused.", "",
             "| feature | flag |", "| --- | --- |"]
    lines += [f"| {markdown_cell(f.name)} | {markdown_cell(f.flag)} |" for f in FEATURES]
    lines += ["", "| feature | refused with | reason | fix |", "| --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(markdown_cell(x) for x in (r.a, r.b, r.reason, r.fix)) + " |" for r in REFUSED]
    lines.append("")
    return lines

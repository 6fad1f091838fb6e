"""Megatron-LM's and Megatron-DeepSpeed's flags that real launch scripts pass and that mean nothing new here: ONE
table (``UPSTREAM_FLAGS``), rendered into docs/flags.md with the parser.

Each row is one of:

- ``NO_EFFECT``: accepted, with one startup line saying why it changes nothing on this engine. Only where that
  is true: a GPU kernel or fusion choice (torch's kernels compute the same math), a communication-overlap or
  memory knob, a checkpoint-format or logging-series choice this engine does not offer (nothing is lost: the
  run trains the same model; the line says what is not written).
- ``REFUSED``: recognised, and refused with the cause and the fix, because dropping it would change the math
  (a port that silently loses FP8 or a norm parameterisation would train a different model).

Flags with a real meaning here (``--use-distributed-optimizer``, ``--kv-channels``, the token-based schedule,
...) are ordinary flags in ``megatron.arguments.flags``; this table holds only the two kinds above.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

NO_EFFECT, REFUSED = "no effect here", "refused"


@dataclasses.dataclass(frozen=True)
class UpstreamFlag:
    flag: str
    effect: str                    # NO_EFFECT | REFUSED
    why: str                       # NO_EFFECT: why nothing changes; REFUSED: the cause and the fix
    metavar: Optional[str] = None  # the value it takes (None: a switch)
    nargs: Optional[str] = None    # "+": several values, as Megatron-LM's flag takes them

    @property
    def dest(self) -> str:
        return "upstream_" + self.flag.lstrip("-").replace("-", "_")

    def message(self, value=None) -> str:
        shown = self.flag if self.metavar is None else \
            f"{self.flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        return f"{shown} has no effect here: {self.why}" if self.effect == NO_EFFECT else \
            f"{shown} is not supported: {self.why}"


_KERNEL = "a fused-kernel choice of Megatron's CUDA build; torch's kernels compute the same math"
_OVERLAP = ("a communication-overlap knob of Megatron's own data-parallel engine; DeepSpeed's engine schedules its "
            "reductions itself (its ZeRO overlap_comm is set in the DeepSpeed JSON)")
_CKPT = ("checkpoints are written in DeepSpeed's layout (Megatron-DeepSpeed's, readable by the universal and Hugging "
         "Face converters in tools/convert_checkpoint), whatever format is named")
_FSDP = ("Megatron-FSDP is Megatron-LM's own sharded data-parallel engine; here DeepSpeed's ZeRO-3 shards the "
         "parameters, gradients and optimizer state over the data-parallel ranks: use --zero-stage 3 instead")
_NON_PERSISTENT = ("Megatron-LM's non-persistent checkpoint tier (frequent snapshots to node-local or global scratch, only "
                   "the newest kept) is not built here, and a run would otherwise go on believing it has those "
                   "recovery points: save more often with --save-interval and --async-save instead (the step is "
                   "blocked for the copy to host memory only: 0.20 s against 3.41 s for a synchronous save of 1 GB, "
                   "benchmarks/bench_checkpoint.py) with --keep-last-n-checkpoints")
_FP8_PARAM_GATHER = ("Megatron-LM keeps FP8 copies of the weights and all-gathers those (1 byte per parameter); "
                     "here the FP8 GEMMs (--fp8-format) quantize the bf16 weights inside each product and ZeRO "
                     "gathers the bf16 parameters (2 bytes per parameter). The GEMMs get the same FP8 weights but "
                     "for one extra rounding (fp32 -> bf16 -> fp8 instead of fp32 -> fp8)")


def _no_effect(flag: str, why: str, metavar: Optional[str] = None, nargs: Optional[str] = None) -> UpstreamFlag:
    return UpstreamFlag(flag, NO_EFFECT, why, metavar, nargs)


def _refused(flag: str, why: str, metavar: Optional[str] = None) -> UpstreamFlag:
    return UpstreamFlag(flag, REFUSED, why, metavar)


UPSTREAM_FLAGS = (
    # which implementation / kernel
    _no_effect("--use-mcore-models", "there is one model implementation here (Megatron-core's layer layout)"),
    _no_effect("--use-legacy-models", "there is one model implementation here (Megatron-core's layer layout); its "
               "checkpoints convert to and from the legacy layout's"),
    _no_effect("--transformer-impl", "one implementation of the layers here, on torch's kernels (Transformer Engine "
               "and Megatron's local modules compute the same math)", "IMPL"),
    _no_effect("--use-flash-attn", "attention kernels are chosen by --attention-backend (auto: flash / SDPA where "
               "the device has them); the math is the same"),
    _no_effect("--use-flash-attn-v1", "attention kernels are chosen by --attention-backend; the math is the same"),
    _no_effect("--use-flash-attn-v2", "attention kernels are chosen by --attention-backend; the math is the same"),
    _no_effect("--use-flash-attn-triton", "attention kernels are chosen by --attention-backend; the math is the "
               "same"),
    _no_effect("--no-masked-softmax-fusion", _KERNEL),
    _no_effect("--no-bias-gelu-fusion", _KERNEL),
    _no_effect("--no-bias-swiglu-fusion", _KERNEL),
    _no_effect("--no-bias-dropout-fusion", _KERNEL),
    _no_effect("--no-rope-fusion", _KERNEL),
    _no_effect("--no-persist-layer-norm", _KERNEL),
    _no_effect("--no-gradient-accumulation-fusion", _KERNEL),
    _no_effect("--cross-entropy-loss-fusion", _KERNEL),
    _no_effect("--cross-entropy-fusion-impl", _KERNEL, "IMPL"),
    _no_effect("--no-query-key-layer-scaling", "query-key layer scaling is never applied here: it is an fp16 "
               "overflow guard of Megatron's fused softmax that cancels inside the softmax (computed in fp32 here)"),
    _no_effect("--apply-query-key-layer-scaling", "query-key layer scaling is an fp16 overflow guard of Megatron's "
               "fused softmax that cancels inside the softmax; the softmax is computed in fp32 here"),
    _no_effect("--abort-on-unmet-fused-kernel-constraints", "there are no CUDA fused kernels here (torch's own "
               "kernels have no constraints to meet)"),
    _no_effect("--moe-grouped-gemm", "each rank's experts always run as one grouped GEMM per weight over their tokens "
               "(torch._grouped_mm; a padded batched matmul where shapes do not allow it)"),
    _no_effect("--moe-router-fusion", _KERNEL),
    _no_effect("--moe-permute-fusion", "tokens are permuted by index_select / index_add (no fused Transformer Engine "
               "permute kernel here); the result is the same"),
    # communication overlap
    _no_effect("--overlap-grad-reduce", _OVERLAP),
    _no_effect("--overlap-param-gather", _OVERLAP),
    _no_effect("--overlap-param-gather-with-optimizer-step", _OVERLAP),
    _no_effect("--no-async-tensor-model-parallel-allreduce", "an overlap knob of Megatron's tensor-parallel linear "
               "layers; the reductions here are synchronous, the sums the same"),
    _no_effect("--delay-wgrad-compute", "Megatron-LM computes the weight gradients of a layer later, to overlap "
               "them with the expert-parallel exchanges; each weight gets the same gradient, computed at another "
               "moment"),
    _no_effect("--moe-flex-dispatcher-backend", "the flex dispatcher runs as alltoall here (see "
               "--moe-token-dispatcher-type): DeepEP's and HybridEP's kernels move the same tokens to the same "
               "experts", "BACKEND"),
    _no_effect("--moe-router-padding-for-fp8", "Megatron-LM pads each expert's token count to a multiple of 16 for "
               "Transformer Engine's FP8 GEMM shapes with tokens of routing weight 0, which add nothing to the "
               "outputs or the gradients; the FP8 GEMMs here need no padding"),
    _no_effect("--moe-router-padding-for-quantization", "Megatron-LM pads each expert's token count to the "
               "quantized GEMM's multiple with tokens of routing weight 0, which add nothing to the outputs or the "
               "gradients; the FP8 GEMMs here need no padding"),
    _no_effect("--tp-comm-overlap", "Transformer Engine's userbuffer overlap of tensor-parallel communication; the "
               "reductions here are torch.distributed's, the sums the same"),
    # memory and host knobs
    _no_effect("--empty-unused-memory-level", "a CUDA caching-allocator knob (torch.cuda.empty_cache between steps); "
               "it frees cached memory, the computation is the same", "LEVEL"),
    _no_effect("--manual-gc", "Python's garbage collector runs as usual; when it runs changes no number"),
    _no_effect("--manual-gc-interval", "Python's garbage collector runs as usual; when it runs changes no number",
               "STEPS"),
    _no_effect("--enable-cuda-graph", "CUDA graphs replay the same kernels; this engine launches them eagerly"),
    _no_effect("--cuda-graph-scope", "CUDA graphs replay the same kernels; this engine launches them eagerly",
               "SCOPE", "+"),
    _no_effect("--cuda-graph-impl", "CUDA graphs replay the same kernels; this engine launches them eagerly",
               "IMPL"),
    # data loading
    _no_effect("--no-mmap-bin-files", "the .bin files are memory-mapped; reading them whole gives the same tokens"),
    _no_effect("--no-create-attention-mask-in-dataloader", "the data loader never builds an attention mask here: "
               "causal masking happens inside attention"),
    _no_effect("--mmap-warmup", "the .bin files are memory-mapped on demand; warming the page cache changes no "
               "token"),
    _no_effect("--vocab-size", "the vocabulary is the tokenizer's (Megatron-LM reads this flag for its NullTokenizer "
               "and TikTokenizer, which are not offered here; its HuggingFaceTokenizer ignores it too)", "SIZE"),
    # checkpoint formats
    _no_effect("--ckpt-format", _CKPT, "FORMAT"),
    _no_effect("--use-dist-ckpt", _CKPT),
    _no_effect("--auto-detect-ckpt-format", _CKPT),
    _no_effect("--dist-ckpt-strictness", _CKPT, "MODE"),
    _no_effect("--ckpt-fully-parallel-save", _CKPT),
    _no_effect("--ckpt-fully-parallel-load", _CKPT),
    # logging series this engine does not write (the run and its other series are unchanged)
    _no_effect("--log-optimizer-states-to-tensorboard", "the optimizer-state norms series (Megatron-DeepSpeed's "
               "optimizer/* tags) are not written by this engine; the loss, learning rate, grad norm and batch "
               "series are"),
    _no_effect("--log-params-norm", "the parameter-norm series is not written by this engine; the loss, learning "
               "rate and grad-norm series are"),
    _no_effect("--log-num-zeros-in-grad", "the zeros-in-gradient count is not written by this engine; the loss, "
               "learning rate and grad-norm series are"),
    _no_effect("--logging-level", "this engine logs at INFO on rank 0 (Python's logging; set LOGLEVEL-style "
               "filters with logging's own configuration)", "LEVEL"),
    _no_effect("--enable-experimental", "Megatron-LM's gate for its experimental code paths (fused kernels such "
               "as the routing-map padding's); nothing here is behind a gate: each feature has its own flag"),
    _no_effect("--no-save-optim", "checkpoints keep the optimizer state (DeepSpeed writes it with the model); more "
               "is written, the run is the same (--no-load-optim skips it on loading)"),
    _no_effect("--use-nccl-ub", "NCCL user-buffer registration speeds communication; the sums are the same"),
    # what would change the math: refused with the cause
    _no_effect("--fp8-param-gather", _FP8_PARAM_GATHER),
    _refused("--use-megatron-fsdp", _FSDP),
    _refused("--data-parallel-sharding-strategy", _FSDP, "STRATEGY"),
    _refused("--megatron-fsdp-main-grads-dtype", _FSDP, "DTYPE"),
    _refused("--megatron-fsdp-grad-comm-dtype", _FSDP, "DTYPE"),
    _refused("--fsdp-double-buffer", _FSDP),
    _refused("--non-persistent-save-interval", _NON_PERSISTENT, "N"),
    _refused("--non-persistent-ckpt-type", _NON_PERSISTENT, "TYPE"),
    _refused("--non-persistent-global-ckpt-dir", _NON_PERSISTENT, "DIR"),
    _refused("--non-persistent-local-ckpt-dir", _NON_PERSISTENT, "DIR"),
    _refused("--non-persistent-local-ckpt-algo", _NON_PERSISTENT, "ALGO"),
)
BY_FLAG = {row.flag: row for row in UPSTREAM_FLAGS}


def add_upstream_arguments(parser) -> None:
    g = parser.add_argument_group(
        "Megatron flags with no effect here, or refused",
        "Accepted so that Megatron-LM and Megatron-DeepSpeed launch scripts run unchanged: each one set logs why it "
        "changes nothing on this engine, or stops the job naming the cause and the fix (the table in "
        "megatron/arguments/upstream_flags.py).")
    for row in UPSTREAM_FLAGS:
        kind = "No effect here" if row.effect == NO_EFFECT else "Refused"
        if row.metavar is None:
            g.add_argument(row.flag, dest=row.dest, action="store_true", help=f"{kind}: {row.why}.")
        else:
            g.add_argument(row.flag, dest=row.dest, default=None, metavar=row.metavar, nargs=row.nargs,
                           help=f"{kind}: {row.why}.")


def _given(args):
    for row in UPSTREAM_FLAGS:
        value = getattr(args, row.dest, None)
        if value not in (None, False):
            yield row, value


def upstream_warnings(args) -> list[str]:
    """The startup lines of the no-effect flags set."""
    return [row.message(value) for row, value in _given(args) if row.effect == NO_EFFECT]


def check_upstream_flags(args) -> None:
    """A ValueError for the refused flags set: all of them in one message, those refused for one cause together."""
    by_cause: dict[str, list[str]] = {}
    for row, value in _given(args):
        if row.effect == REFUSED:
            by_cause.setdefault(row.why, []).append(row.flag if row.metavar is None else f"{row.flag} {value}")
    if by_cause:
        raise ValueError("; ".join(f"{', '.join(flags)}: not supported here: {why}" for why, flags in by_cause.items()))

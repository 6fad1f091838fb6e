"""FP8Config: FP8 training (``--fp8-format``, Megatron-LM's ``--fp8-*`` flags) and its rules.

Pure data (no torch). The GEMMs of the column- and row-parallel layers (and of the MoE experts) run with FP8
operands through ``torch._scaled_mm``; norms, softmax, the embedding and the output layer stay in the run's
precision; parameters and optimizer masters keep their dtypes (FP8 is a compute format here). The numerics are
``megatron.parallel.fp8_quantize``, the layers' use of them ``megatron.parallel.fp8_linear``.

Recipes (Megatron-LM's names, Transformer Engine's meanings):

    tensorwise  one scale per tensor from its current amax (Float8CurrentScaling): scale = max / amax
    delayed     one scale per tensor from the amax history of earlier iterations (DelayedScaling):
                scale = max / amax_history_reduced / 2^margin; the history is updated once per iteration, with
                the amax of every micro-batch reduced over the ranks of the pipeline stage
    blockwise   DeepSeek-V3's: 1 x 128 blocks for activations and gradients, 128 x 128 for weights, one
                power-of-two fp32 scale per block (Float8BlockScaling's default)
    mxfp8       OCP MX: 1 x 32 blocks for every operand, e8m0 (power-of-two) scales, e4m3 everywhere

Formats: e4m3 for every operand, or hybrid (e4m3 forward, e5m2 for the output gradients).
"""

from __future__ import annotations

import dataclasses

from megatron.config._checks import _one_of

__all__ = ["FP8Config", "FP8_FORMATS", "FP8_RECIPES", "FP8_AMAX_COMPUTE_ALGOS", "FP8_MAX", "BLOCKWISE_BLOCK",
           "MXFP8_BLOCK"]

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
FP8_AMAX_COMPUTE_ALGOS = ("most_recent", "max")
# the largest finite value of each FP8 element type (OCP 8-bit floating point specification)
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
BLOCKWISE_BLOCK = 128  # blockwise: 1 x 128 activation / gradient blocks, 128 x 128 weight tiles
MXFP8_BLOCK = 32       # mxfp8: 1 x 32 blocks along the reduction dimension


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """What ``--fp8-format`` turns on; the fields are Megatron-LM's flags without the ``--``."""

    fp8_format: str = "e4m3"              # --fp8-format: e4m3 | hybrid
    fp8_recipe: str = "delayed"           # --fp8-recipe (Megatron-LM's default)
    fp8_margin: int = 0                   # --fp8-margin (delayed): scales divided by 2^margin
    fp8_amax_history_len: int = 1         # --fp8-amax-history-len (delayed)
    fp8_amax_compute_algo: str = "most_recent"  # --fp8-amax-compute-algo (delayed): most_recent | max
    fp8_wgrad: bool = True                # False (--no-fp8-wgrad): the weight gradient in the run's precision
    first_last_layers_bf16: bool = False  # --first-last-layers-bf16: the first / last layers without FP8
    num_layers_at_start_in_bf16: int = 1  # --num-layers-at-start-in-bf16 (with --first-last-layers-bf16)
    num_layers_at_end_in_bf16: int = 1    # --num-layers-at-end-in-bf16 (with --first-last-layers-bf16)

    @property
    def forward_dtype(self) -> str:
        """The element type of activations and weights."""
        return "e4m3"

    @property
    def grad_dtype(self) -> str:
        """The element type of output gradients: e5m2 under hybrid (not under mxfp8, which is e4m3 throughout,
        nor blockwise, whose per-block scales need no wider range: both as Transformer Engine runs them)."""
        return "e5m2" if self.fp8_format == "hybrid" and self.fp8_recipe in ("tensorwise", "delayed") else "e4m3"

    def bf16_layers(self, num_layers: int) -> frozenset[int]:
        """The transformer layers (0-based, of the whole model) that run without FP8."""
        if not self.first_last_layers_bf16:
            return frozenset()
        start = range(self.num_layers_at_start_in_bf16)
        end = range(num_layers - self.num_layers_at_end_in_bf16, num_layers)
        return frozenset(start) | frozenset(end)

    def validate(self, num_layers: int, pipeline_model_parallel_size: int = 1) -> "FP8Config":
        _one_of("--fp8-format", self.fp8_format, FP8_FORMATS)
        _one_of("--fp8-recipe", self.fp8_recipe, FP8_RECIPES)
        _one_of("--fp8-amax-compute-algo", self.fp8_amax_compute_algo, FP8_AMAX_COMPUTE_ALGOS)
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be at least 1, got {self.fp8_amax_history_len}")
        if self.fp8_margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.fp8_margin}")
        if self.first_last_layers_bf16:
            if self.fp8_recipe == "delayed":
                raise ValueError("--first-last-layers-bf16 with --fp8-recipe delayed: delayed scaling does not "
                                 "support layers in bf16 (as in Megatron-LM); use --fp8-recipe tensorwise, "
                                 "blockwise or mxfp8")
            per_stage = num_layers // pipeline_model_parallel_size
            for flag, value in (("--num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
                                ("--num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16)):
                if not 0 <= value <= per_stage:
                    raise ValueError(f"{flag} {value} must be between 0 and the layers per pipeline stage "
                                     f"({per_stage})")
        return self

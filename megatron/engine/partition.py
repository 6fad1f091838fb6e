"""Which pipeline layers each stage holds, by DeepSpeed's own rule, without building the model.

``PipelineModule._partition_layers`` (deepspeed 0.19.8) splits the layer specs of
``megatron.engine.pipeline.layer_specs`` into contiguous runs, one per stage, with

- ``uniform``: ``partition_uniform`` over the number of specs;
- ``parameters``: ``partition_balanced`` over each spec's parameter count on one TP rank (DeepSpeed
  builds every layer to count them; here the caller passes the counts, since building a 176B model's
  layers to count them would take minutes and tens of GB);
- ``type:REGEX``: ``partition_balanced`` over 1 for the specs whose class name matches REGEX
  (case-insensitive, DeepSpeed's own ``_find_layer_type``), 0 for the others.

The result is DeepSpeed's ``parts``: stage ``i`` holds the pipeline items ``parts[i] .. parts[i+1] - 1``
(``megatron.model.layout.pipeline_items`` says what each is). Used by ``pretrain_gpt.py --dry-run``.
"""

from __future__ import annotations

import types
from typing import Optional, Sequence

from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.utils import partition_balanced, partition_uniform

from megatron.config import PARTITION_METHODS, ModelConfig
from megatron.engine.pipeline import layer_specs
from megatron.parallel.state import ParallelState


def stage_bounds(config: ModelConfig, num_stages: int, method: str,
                 param_counts: Optional[Sequence[int]] = None) -> list[int]:
    """DeepSpeed's ``parts`` for ``config`` on ``num_stages`` stages with ``--pp-partition-method method``.

    param_counts: for ``parameters`` only, the parameters of each pipeline item on one TP rank.
    """
    if method not in PARTITION_METHODS:
        raise ValueError(f"--pp-partition-method {method!r} is not one of {', '.join(PARTITION_METHODS)}")
    specs = layer_specs(config, ParallelState.single(), None)  # specs only: no module is built
    method = method.lower()
    if method == "uniform":
        parts = partition_uniform(num_items=len(specs), num_parts=num_stages)
    elif method == "parameters":
        if param_counts is None or len(param_counts) != len(specs):
            raise ValueError(f"the 'parameters' partition needs one parameter count per pipeline item ({len(specs)}), "
                             f"got {None if param_counts is None else len(param_counts)}")
        parts = partition_balanced(weights=list(param_counts), num_parts=num_stages)
    else:
        pattern = method.split(":", 1)[1]
        weights = [0] * len(specs)
        # DeepSpeed's matching itself (it reads only the spec list), so the class names are judged as it judges them
        for index in PipelineModule._find_layer_type(types.SimpleNamespace(_layer_specs=specs), pattern):
            weights[index] = 1
        parts = partition_balanced(weights=weights, num_parts=num_stages)
    return [int(p) for p in parts]

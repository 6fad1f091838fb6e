"""Which pipeline layers each stage holds, without building the model: ``--pp-partition-method`` on our specs.

The rule itself is ``megatron.parallel.pipeline_partition.stage_bounds`` (DeepSpeed's ``PipelineModule``
partitioning, in plain Python; tests/engine/test_partition.py checks it against DeepSpeed's own). Here it is
given the class names of ``megatron.engine.pipeline.layer_specs``, which ``type:REGEX`` matches, and for
``parameters`` the caller's counts of each pipeline item's parameters on one TP rank (DeepSpeed builds every
layer to count them; building a 176B model's layers would take minutes and tens of GB).

The result is DeepSpeed's ``parts``: stage ``i`` holds the pipeline items ``parts[i] .. parts[i+1] - 1``
(``megatron.model.layout.pipeline_items`` says what each is). Used by ``pretrain_gpt.py --dry-run``.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron.config import PARTITION_METHODS, ModelConfig
from megatron.engine.pipeline import layer_specs
from megatron.parallel import pipeline_partition
from megatron.parallel.state import ParallelState


def spec_class_name(spec) -> str:
    """The name DeepSpeed's ``type:REGEX`` partition matches: a spec's class, or a plain function's name."""
    typename = getattr(spec, "typename", None)
    return typename.__name__ if typename is not None else spec.__name__


def stage_bounds(config: ModelConfig, num_stages: int, method: str,
                 param_counts: Optional[Sequence[int]] = None) -> list[int]:
    """DeepSpeed's ``parts`` for ``config`` on ``num_stages`` stages with ``--pp-partition-method method``.

    param_counts: for ``parameters`` only, the parameters of each pipeline item on one TP rank.
    """
    if method not in PARTITION_METHODS:
        raise ValueError(f"--pp-partition-method {method!r} is not one of {', '.join(PARTITION_METHODS)}")
    names = [spec_class_name(spec) for spec in layer_specs(config, ParallelState.single(), None)]  # no module built
    return pipeline_partition.stage_bounds(method, names, num_stages, param_counts)

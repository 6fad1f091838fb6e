"""Which pipeline layers each stage holds, without building the model: ``--pp-partition-method`` on our specs.

The rule itself is ``megatron.parallel.pipeline_partition.stage_bounds`` (DeepSpeed's ``PipelineModule``
partitioning, in plain Python; tests/engine/test_partition.py checks it against DeepSpeed's own). Here it is
given the class names of ``megatron.engine.pipeline.layer_specs``, which ``type:REGEX`` matches, and for
``parameters`` the caller's counts of each pipeline item's parameters on one TP rank (DeepSpeed builds every
layer to count them; building a 176B model's layers would take minutes and tens of GB).

The result is DeepSpeed's ``parts``: stage ``i`` holds the pipeline items ``parts[i] .. parts[i+1] - 1``
(``megatron.model.layout.pipeline_items`` says what each is). Used by ``pretrain_gpt.py --dry-run``.

``virtual_stage_bounds`` is the one split the engine builds and the dry run reports: over PP x v (virtual) stages,
the pipeline layout flags' (``megatron.config.pipeline_layout``) where the run gives them, else the partition
method's.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron.config import PARTITION_METHODS, ModelConfig, ParallelConfig
from megatron.config.pipeline_layout import item_bounds
from megatron.engine.pipeline import layer_specs
from megatron.model.layout import TRANSFORMER, pipeline_items
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


def virtual_stage_bounds(config: ModelConfig, parallel: ParallelConfig,
                         param_counts: Optional[Sequence[int]] = None) -> list[int]:
    """DeepSpeed's ``parts`` over the run's PP x v (virtual) stages, in Megatron-LM's order (virtual stage ``s`` is
    chunk ``s // PP`` of pipeline rank ``s % PP``): the layout flags' contents where given, else
    ``--pp-partition-method``'s split (param_counts: as for ``stage_bounds``)."""
    stages = parallel.stage_contents(config.num_layers, config.mtp_num_layers)
    num_stages = parallel.pipeline_model_parallel_size * parallel.num_virtual_stages_per_pipeline_rank
    if stages is None:
        return stage_bounds(config, num_stages, parallel.pp_partition_method, param_counts)
    kinds = [item.kind for item in pipeline_items(config)]
    first, last = kinds.index(TRANSFORMER), len(kinds) - 1 - kinds[::-1].index(TRANSFORMER)
    return item_bounds(stages, lead_items=first, tail_items=len(kinds) - 1 - last)

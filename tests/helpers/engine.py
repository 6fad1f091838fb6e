"""DeepSpeed's own pipeline partitioning, run on our layer specs without building a model."""

import types

from deepspeed.runtime.pipe.module import PipelineModule


class DeepSpeedPartition:
    """A stand-in for DeepSpeed's ``PipelineModule`` holding ``specs`` over ``num_stages`` stages: what its
    ``_partition_layers`` reads of the module, and DeepSpeed's own methods (``_partition_layers(method)``
    sets ``parts``; ``_count_layer_params()``)."""

    _partition_layers = PipelineModule._partition_layers
    _count_layer_params = PipelineModule._count_layer_params
    _find_layer_type = PipelineModule._find_layer_type

    def __init__(self, specs, num_stages):
        self._layer_specs, self.num_stages = specs, num_stages
        self.global_rank, self.loss_fn = 1, None  # not rank 0: no printing
        self._topo = types.SimpleNamespace(get_coord=lambda rank: types.SimpleNamespace(pipe=0))

    def _set_bounds(self, start, stop):
        pass

"""Tensor parallelism, written here rather than taken from DeepSpeed.

What lives here: ParallelState (the tp / pp / dp groups, laid out like DeepSpeed's
PipeModelDataParallelTopology), autograd-aware collectives (mappings), Column/RowParallelLinear and
VocabParallelEmbedding (layers), vocab-parallel cross-entropy, the RNG states tracker, small
helpers (utils), and which pipeline items each stage holds (pipeline_partition: DeepSpeed's rule, plain Python).

Imports only torch: never deepspeed, global arguments or environment variables. Process groups are
passed explicitly; a group of ``None`` means one rank (collectives are the identity).
"""

from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.layers import (
                                      ColumnParallelLinear,
                                      RowParallelLinear,
                                      VocabParallelEmbedding,
                                      default_init_method,
)
from megatron.parallel.mappings import (
                                      copy_to_tensor_model_parallel_region,
                                      gather_from_sequence_parallel_region,
                                      gather_from_tensor_model_parallel_region,
                                      reduce_from_tensor_model_parallel_region,
                                      reduce_scatter_to_sequence_parallel_region,
                                      scatter_to_sequence_parallel_region,
                                      scatter_to_tensor_model_parallel_region,
)
from megatron.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, model_parallel_rng_seed
from megatron.parallel.state import ParallelState, group_layout, group_rank, group_size
from megatron.parallel.utils import (
                                      divide,
                                      param_is_tensor_parallel,
                                      set_tensor_model_parallel_attributes,
                                      split_tensor_along_last_dim,
)

__all__ = [
    "ParallelState", "group_layout", "group_rank", "group_size",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "default_init_method",
    "vocab_parallel_cross_entropy",
    "RNGStatesTracker", "MODEL_PARALLEL_RNG", "model_parallel_rng_seed",
    "divide", "split_tensor_along_last_dim", "set_tensor_model_parallel_attributes",
    "param_is_tensor_parallel",
]

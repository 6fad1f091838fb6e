"""Tensor parallelism, written here rather than taken from DeepSpeed.

What lives here:

    state              ParallelState: the tp / pp / dp / sp / cp / ep groups, laid out like DeepSpeed's
                       PipeModelDataParallelTopology (sizes: megatron.config.parallel_dims); LayerGroups, the
                       groups one transformer layer works over, handed to it as one object
    mappings           autograd-aware collectives over the tensor-parallel group
    layers             ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    cross_entropy      vocab-parallel cross-entropy, without gathering the [s, b, v] logits
    random             the RNG states tracker: named generator states, so dropout differs across TP ranks where it must
    recompute          recomputing a part of a layer in backward with its output freed once consumed
                       (--recompute-modules: norms, activations, MLA's up-projections)
    replicated         keeping the parameters replicated across TP ranks equal (--sync-tp-duplicated-parameters)
    utils              small helpers shared by the layers: checked division, splitting, param tags
    pipeline_partition  which pipeline items each stage holds: DeepSpeed's rule, plain Python
    all_to_all         the autograd all-to-all with uneven splits that expert parallelism exchanges tokens with
    context_parallel   context parallelism's sequence layout and its ring exchange (``--context-parallel-size``)
    weight_grad_store  deferred weight gradients for zero-bubble pipeline schedules (ZB-H1)
    fp8_quantize       FP8 quantizers (per tensor, 1 x 128 / 128 x 128 blocks, MXFP8) and the scaled GEMM on them
    fp8_linear         FP8 GEMMs in the column- and row-parallel layers; delayed scaling's state and its update

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
from megatron.parallel.state import LayerGroups, ParallelState, group_layout, group_rank, group_size
from megatron.parallel.utils import (
                                      divide,
                                      param_is_tensor_parallel,
                                      set_tensor_model_parallel_attributes,
                                      split_tensor_along_last_dim,
)

__all__ = [
    "ParallelState", "LayerGroups", "group_layout", "group_rank", "group_size",
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

"""Configuration dataclasses: what the model, the parallel layout and the run need, validated.

Entry points turn command-line flags (``megatron.arguments``) into these; library code reads only
these, never global arguments. Field names follow Megatron-DeepSpeed's flag names. ``validate()``
raises ``ValueError`` naming the values and the fix.

Split by concern: ``model`` (the architecture, its FLOPs), ``data`` (data paths, groups, the
tokenizer), ``optimizer`` (the optimizer and its learning-rate schedule) and ``run`` (everything else, and
``RunConfig`` grouping it all); import them from here.
Beside them, three pure helpers every layer may read: ``deepspeed`` (the DeepSpeed config dict a
``RunConfig`` gives, merged with the user's JSON; it never imports deepspeed), ``launch`` (rank
and world size as the launcher set them) and ``schedules`` (the registry of pipeline schedules: their rules,
formulas and the timeline simulator that counts their bubble). Imports nothing else of megatron.

The rules each feature adds across a ``RunConfig``, and their helpers:

    combinations       the one table of refused feature combinations: which two do not work together, why, instead
    parallel_dims      the one list of parallel dimensions: name, flag, world factor, ZeRO sharding, resume rule
    moe                MoEConfig: the mixture-of-experts MLP, and the run rules it adds
    mla                MLAConfig: multi-head latent attention (DeepSeek-V2 / V3)
    fp8                FP8Config: FP8 training (--fp8-format, --fp8-recipe and the other --fp8-* flags)
    muon               the Muon optimizer's --muon-* choices, Newton-Schulz coefficient sets and rules
    optimizer          OptimizerConfig and LRScheduleConfig: the client optimizer and its learning-rate schedule
    context_parallel   the rules of context parallelism (``--context-parallel-size``, ring attention)
    pipeline_schedule  which layouts interleaved virtual stages can run, each refused with the fix
    pipeline_layout    Megatron-LM's pipeline layout flags: which layers each (virtual) pipeline stage holds
    zero_bubble        what the ZB-H1 pipeline schedule (``--enable-zbh1-pipeline``) needs of a run
    hardware           what this machine computes fast: bf16 hardware or not, from the CPU's flags (or CUDA)
    _checks            small validation helpers shared by the config modules
"""

from megatron.config.data import (
    DATA_IMPLS,
    DEFAULT_TOKENIZER_TYPE,
    TOKENIZER_FILES,
    TOKENIZER_TYPES,
    DataConfig,
    DatasetGroup,
    DatasetSplit,
    TokenizerConfig,
)
from megatron.config.model import (
                                 ATTENTION_BACKENDS,
                                 NORMALIZATIONS,
                                 PARAMS_DTYPES,
                                 POSITION_EMBEDDING_TYPES,
                                 ModelConfig,
)
from megatron.config.run import (
                                 CP_COMM_TYPES,
                                 DISTRIBUTED_BACKENDS,
                                 LR_DECAY_STYLES,
                                 OPTIMIZERS,
                                 PARTITION_METHODS,
                                 BatchConfig,
                                 CheckpointConfig,
                                 ExitConfig,
                                 LoggingConfig,
                                 LRScheduleConfig,
                                 OptimizerConfig,
                                 ParallelConfig,
                                 PrecisionConfig,
                                 RunConfig,
                                 TrainingConfig,
                                 check_rampup_batch_size,
                                 deepspeed_zero_stage,
)

__all__ = ["ModelConfig", "ATTENTION_BACKENDS", "POSITION_EMBEDDING_TYPES", "NORMALIZATIONS", "PARAMS_DTYPES",
           "DataConfig", "DatasetGroup", "DatasetSplit", "TOKENIZER_TYPES", "TOKENIZER_FILES", "DEFAULT_TOKENIZER_TYPE",
           "TokenizerConfig", "DATA_IMPLS",
           "ParallelConfig", "OptimizerConfig", "LRScheduleConfig", "BatchConfig", "PrecisionConfig", "TrainingConfig",
           "LoggingConfig", "CheckpointConfig", "ExitConfig", "RunConfig", "PARTITION_METHODS", "DISTRIBUTED_BACKENDS",
           "LR_DECAY_STYLES", "OPTIMIZERS", "check_rampup_batch_size", "deepspeed_zero_stage", "CP_COMM_TYPES"]

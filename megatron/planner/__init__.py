"""Planning and accounting for parallel layouts: what fits, how fast it should run, what it sends.

    specs.py        GPU types, cluster fabrics (documented constants), model shapes (GPT / BLOOM / Llama-style:
                    GQA, SwiGLU, untied head) and named BLOOM and Llama sizes
    memory.py       bytes per rank: weights, gradients, optimizer state (per DeepSpeed optimizer),
                    activations (Korthikanti et al. 2022; with SP and Ulysses), 1F1B in-flight micro-batches
    performance.py  step time from a compute + communication model, TFLOPs, MFU
    schedule_costs.py  pipeline schedules (1F1B, ZB-H1, interleaved) in the planner: bubble, micro-batches in
                    flight, deferred weight-gradient passes, p2p bytes (the rules: megatron.config.schedules)
    candidate.py    one candidate parallel layout and how it splits the model's layers over pipeline stages
    search.py       enumerate (TP, PP, DP, SP, Ulysses, micro-batch, recompute, ZeRO, schedule) layouts, rank them;
                    the longest sequence each family of layouts fits
    moe.py          mixture of experts: experts per (TP, EP) rank, the token all-to-all bytes, EP layout rules
    context_parallel.py  context parallelism (ring attention): what the kernel keeps, its buffers, the ring's
                    p2p bytes per layer and the part the block computation does not hide
    fp8.py          FP8 GEMMs (--fp8-format): which layers' GEMMs run FP8, their FLOPs, the quantizers' HBM traffic,
                    the transient FP8 weight and delayed scaling's buffers
    comm_count.py   the analytic count of collectives / p2p in one step, and a recorder that
                    counts the real ones (wrapping torch.distributed) to compare with
    comm_zero.py    the data-parallel collectives of one optimizer step under ZeRO-2, ZeRO-3 and hpZ (one pipeline
                    stage)

Pure arithmetic on plain dataclasses: nothing here imports deepspeed, and torch only inside
``comm_count.CollectiveRecorder``. Used by tools/plan_parallelism.py and benchmarks/.
"""

from megatron.planner.memory import MemoryEstimate, estimate_memory, stage_param_counts
from megatron.planner.performance import StepEstimate, estimate_step
from megatron.planner.search import Layout, Plan, plan_layouts
from megatron.planner.specs import (
                                    BLOOM_SIZES,
                                    CLUSTERS,
                                    GPUS,
                                    LLAMA_SIZES,
                                    MODEL_SIZES,
                                    ClusterSpec,
                                    GPUSpec,
                                    ModelShape,
                                    model_shape_of,
)

__all__ = ["BLOOM_SIZES", "LLAMA_SIZES", "MODEL_SIZES", "CLUSTERS", "GPUS", "ClusterSpec", "GPUSpec", "Layout",
           "MemoryEstimate", "ModelShape", "Plan", "StepEstimate", "estimate_memory", "estimate_step", "model_shape_of",
           "plan_layouts", "stage_param_counts"]

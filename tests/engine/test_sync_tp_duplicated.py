"""--sync-tp-duplicated-parameters: replicated parameters that drifted apart across TP ranks are
averaged, in the bf16 module AND in BF16_Optimizer's fp32 master copies."""

import pytest
import torch

from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv


def _drift_and_sync(rank, world_size, rc):
    import torch.distributed as dist

    from megatron.engine.initialize import build_engine, init_deepspeed_comm
    from megatron.engine.optimizer import sync_tp_duplicated
    from megatron.parallel.replicated import tp_duplicated_parameters
    from megatron.parallel.state import ParallelState

    init_deepspeed_comm("gloo")
    state = ParallelState.create(tp=2, pp=1)
    engine = build_engine(rc, state)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    name, param = [(n, p) for n, p in tp_duplicated_parameters(engine.module) if "input_layernorm.weight" in n][0]
    master = param._hp_mapping.get_hp_fragment()
    with torch.no_grad():  # drift: rank r adds r + 1 to both copies
        param.add_(rank + 1.0)
        master.add_(rank + 1.0)
    sync_tp_duplicated(engine.module, state.tp_group)
    values = {"lp": param.float().tolist(), "hp": master.tolist(), "name": name}
    gathered = [None, None]
    dist.all_gather_object(gathered, values)
    return gathered


@pytest.mark.multiprocess
def test_sync_averages_module_and_master_copies(tiny_corpus):
    from megatron.arguments import run_config_from_argv

    rc = run_config_from_argv(tiny_argv(tiny_corpus, "--bf16", "--tensor-model-parallel-size", "2",
                                        global_batch_size=2), world_size=2)
    results = run_distributed(_drift_and_sync, world_size=2, args=(rc,), timeout=300)
    rank0, rank1 = results[0]
    assert rank0["lp"] == rank1["lp"] and rank0["hp"] == rank1["hp"], rank0["name"]
    # LayerNorm weights start at 1; drift +1 and +2 averages to 1 + 1.5. Exact in fp32 and in bf16 alike: 2, 3,
    # their sum 5 and its half 2.5 are all representable.
    assert rank0["hp"] == [2.5] * len(rank0["hp"])
    assert rank0["lp"] == [2.5] * len(rank0["lp"])

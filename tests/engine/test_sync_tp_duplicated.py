"""--sync-tp-duplicated-parameters: replicated parameters that drifted apart across TP ranks are
averaged, in the bf16 module AND in BF16_Optimizer's fp32 master copies."""

import pytest
import torch

from megatron.testing import run_distributed


def _drift_and_sync(rank, world_size):
    import torch.distributed as dist

    from megatron.config import ModelConfig
    from megatron.engine.initialize import build_engine, init_deepspeed_comm
    from megatron.engine.optimizer import sync_tp_duplicated
    from megatron.model.tp_parameters import tp_duplicated_parameters
    from megatron.parallel.state import ParallelState

    init_deepspeed_comm("gloo")
    state = ParallelState.create(tp=2, pp=1)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128, seq_length=16,
                         hidden_dropout=0.0, attention_dropout=0.0, params_dtype="bf16").validate(2)
    ds_config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
                 "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"},
                 "gradient_clipping": 1.0}
    engine = build_engine(config, state, ds_config, lr=1e-3)
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
def test_sync_averages_module_and_master_copies():
    results = run_distributed(_drift_and_sync, world_size=2, timeout=300)
    rank0, rank1 = results[0]
    assert rank0["lp"] == rank1["lp"] and rank0["hp"] == rank1["hp"], rank0["name"]
    # LayerNorm weights start at 1; drift +1 and +2 averages to 1 + 1.5.
    assert rank0["hp"] == pytest.approx([2.5] * len(rank0["hp"]))
    assert rank0["lp"] == pytest.approx([2.5] * len(rank0["lp"]), rel=1e-2)

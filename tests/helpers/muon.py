"""Muon's multi-process pieces (tests/training/test_muon.py): ``tp_orthogonalize_then_train``, a run_distributed target
that first orthogonalises fixed matrices split over TP = 2 in each --muon-tp-mode (the whole matrices are known to
the test, which computes the references) and then trains each argv (``tests.helpers.training.train``)."""

import torch
import torch.distributed as dist

from tests.helpers.training import train

QKV_ROWS, HIDDEN = (4, 2, 2), 6  # one query group: 2 query heads, a key and a value head, head size 2


def tp_matrices() -> dict:
    """The whole matrices (the same on every rank): name -> (matrix, TP split dim)."""
    generator = torch.Generator().manual_seed(3)
    return {"column": (torch.randn(16, HIDDEN, generator=generator), 0),
            "row": (torch.randn(HIDDEN, 16, generator=generator), 1),
            "qkv": (torch.randn(4 * sum(QKV_ROWS), HIDDEN, generator=generator), 0)}  # 4 query groups


def tp_orthogonalize(rank, world_size) -> dict:
    """TP groups {0, 1} and {2, 3}: each rank's orthogonalised shard of each matrix, per --muon-tp-mode."""
    from megatron.config import OptimizerConfig
    from megatron.engine.muon import Muon

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_group, tp_rank = groups[rank // 2], rank % 2
    out = {}
    for mode in ("duplicated", "blockwise", "distributed"):
        config = OptimizerConfig(optimizer="muon", muon_tp_mode=mode, muon_fp32_matmul_prec="high")
        for name, (matrix, dim) in tp_matrices().items():
            shard = matrix.chunk(2, dim=dim)[tp_rank].clone()
            param = torch.nn.Parameter(shard.clone())
            param.tensor_model_parallel, param.partition_dim = True, dim
            optimizer = Muon([{"params": [param], "muon": True}], config, tp_group=tp_group, qkv_rows=QKV_ROWS,
                             qkv_params=[param] if name == "qkv" else [])
            out[f"{mode} {name}"] = optimizer.orthogonalize(param, shard)
    for group in groups:
        dist.destroy_process_group(group)
    return out


def tp_orthogonalize_then_train(rank, world_size, runs):
    return tp_orthogonalize(rank, world_size), train(rank, world_size, runs)

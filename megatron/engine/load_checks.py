"""After ``--load``: every weight, fp32 master and optimizer state finite, or an error naming the parameter.

A corrupted shard (a flipped bit, bytes overwritten) can decode to NaN or inf that loss and grad
norm do not show for many steps, while the values spread and are saved again. One pass over this
rank's tensors right after loading costs a fraction of a step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.model import GPTModel
from megatron.model.layout import model_name
from megatron.parallel.state import collective_device


def _finite(tensor) -> bool:
    return not torch.is_tensor(tensor) or bool(torch.isfinite(tensor).all())


def nonfinite_tensors(engine, config) -> list[str]:
    """'<what> of <GPTModel parameter name>' for every non-finite tensor this rank holds."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state = getattr(inner, "state", {})
    bad = []
    pipeline = not isinstance(engine.module, GPTModel)  # GPTModel itself under ZeRO-2/3 (megatron.engine.model_engine)
    for name, param in engine.module.named_parameters():
        label = model_name(name, config) if pipeline else name
        if not _finite(param):
            bad.append(f"weights of {label}")
        if not _finite(getattr(param, "ds_tensor", None)):  # ZeRO-3: this rank's partition of the weights
            bad.append(f"weights (this rank's ZeRO-3 partition) of {label}")
        mapping = getattr(param, "_hp_mapping", None)  # BF16_Optimizer / ZeRO: this rank's fp32 fragment
        if mapping is not None and not _finite(mapping.get_hp_fragment()):
            bad.append(f"fp32 master weights of {label}")
        if param in state:  # a plain torch optimizer (fp32 without ZeRO)
            bad += [f"optimizer {key} of {label}" for key, value in state[param].items() if not _finite(value)]
    # The wrapped optimizer's own tensors: under BF16_Optimizer / ZeRO, flat fp32 partitions whose
    # states (Adam's moments) belong to no single parameter.
    named = {id(p) for p in engine.module.parameters()}
    for g, group in enumerate(getattr(inner, "param_groups", [])):
        for p in group["params"]:
            if id(p) in named:
                continue
            if not _finite(p):
                bad.append(f"fp32 partition of parameter group {g}")
            bad += [f"optimizer {key} of the fp32 partition of parameter group {g}"
                    for key, value in state.get(p, {}).items() if not _finite(value)]
    return bad


def check_finite_after_load(engine, config, where: str) -> None:
    """ValueError on every rank if any rank holds a non-finite value (collective over the world)."""
    bad = nonfinite_tensors(engine, config)
    count = torch.tensor([len(bad)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(count)
    if count.item():
        mine = f" here: {', '.join(bad[:5])}" + (f" and {len(bad) - 5} more" if len(bad) > 5 else "") if bad else ""
        raise ValueError(f"{where} holds non-finite values after loading ({count.item()} tensors over all ranks"
                         f"{mine}); the checkpoint is corrupted: resume from an earlier one")

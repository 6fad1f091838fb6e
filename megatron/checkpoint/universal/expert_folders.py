"""Mixture-of-experts parameters in universal checkpoints: one folder per expert parameter, holding every expert.

In a regular checkpoint at expert-parallel size EP > 1, each EP rank's experts are different tensors under one
name (``3.mlp.experts.w1``, ``[E / EP, ...]`` on every rank): the optimizer files of data-parallel rank r hold
EP rank ``r % EP``'s experts, sharded over its expert-data-parallel group (ranks r // EP). DeepSpeed's converter
(``deepspeed.checkpoint.ds_to_universal``) would concatenate all of them as fragments of one tensor. So,
around it (tools/convert_checkpoint/ds_to_universal.py):

    stage_expert_names(tag_dir, staging, config, engine, ep)
        a copy of the tag for the converter (unchanged files linked) in which every expert parameter is named
        per EP rank, ``ep01.3.mlp.experts.w1``: in each optimizer file (its EP rank's) and, for every EP rank,
        in the model-states files' parameter shapes; DeepSpeed then merges each EP rank's shards and TP slices
        on their own (the universal patterns match the prefixed names, ``megatron.checkpoint.universal.patterns``)
    merge_expert_folders(zero_dir, config, engine, ep, tp)
        the EP ranks' folders joined along dim 0 into the parameter's own folder: ``[E, ...]``, each state
        file marked as an expert parameter of E experts (DeepSpeed's universal loader then cuts this run's
        experts, dim 0, before its TP slice) and split along the parameter's own TP dim (``CAT_DIM``)

    save_router_state(tag_dir, out_dir, config), save_fp8_state(tag_dir, out_dir, config)
        buffers outside the optimizer's folders, from the source's layer files (or model states): the routers'
        expert biases to ``router_state.ROUTER_STATE_FILE``, FP8 delayed scaling's state to
        ``fp8_state.FP8_STATE_FILE``; read back at a universal resume (``save_buffer_state`` does both)

An EP = 1 checkpoint needs no staging; its expert folders are marked the same way.

With --expert-tensor-parallel-size 1 below TP (``etp < tp``) the TP ranks hold other, whole experts, which
DeepSpeed's converter would merge as TP slices of one tensor: the staged copy hides the experts from it (their
names dropped from the optimizer files' slice mappings, the model states' shapes and the patterns only they match),
``extract_whole_experts`` cuts each EP rank's fragments out of the optimizer files itself (data-parallel ranks in
order: its expert-data-parallel group's ZeRO shards) into the per-EP-rank folders, and ``merge_expert_folders``
joins them as at TP = 1.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shutil

import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.universal.engines import folder_names
from megatron.checkpoint.universal.fp8_state import FP8_STATE_FILE
from megatron.checkpoint.universal.patterns import C
from megatron.checkpoint.universal.router_state import ROUTER_BUFFER, ROUTER_STATE_FILE
from megatron.checkpoint.zero_files import DEEPSPEED_GLOBALS
from megatron.config import ModelConfig
from megatron.model.layout import ParameterLayout, pipeline_items
from megatron.parallel.fp8_linear import is_fp8_state_key

__all__ = ["EP_PREFIX", "expert_folders", "stage_expert_names", "extract_whole_experts", "merge_expert_folders",
           "save_router_state", "save_fp8_state", "save_buffer_state"]

EP_PREFIX = "ep{:02d}."
_STATES = ("fp32", "exp_avg", "exp_avg_sq")
_OPTIM_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_STATES = "mp_rank_*_model_states.pt"


def _load(path: str):
    return safe_load(path, extra_globals=DEEPSPEED_GLOBALS)


def expert_folders(config: ModelConfig, engine: str) -> dict[str, ParameterLayout]:
    """The expert parameters' ``zero/`` folder names under ``engine``'s naming, to their layout."""
    return {name: p for name, p in folder_names(config, engine).items() if p.expert_parallel}


def _renamed(mapping: dict, experts, ranks) -> dict:
    """``mapping`` (name -> value, in order) with every expert name replaced by its EP-prefixed names."""
    out = type(mapping)()
    for name, value in mapping.items():
        for prefix in ([EP_PREFIX.format(r) for r in ranks] if name in experts else [""]):
            out[prefix + name] = value
    return out


def _whole_ep_rank(dp_rank: int, mp_rank: int, tp: int, ep: int, etp: int) -> int:
    """The EP rank of optimizer file (dp_rank, mp_rank) with experts whole over TP (``megatron.parallel.state``'s
    expert order over the stage-local index l = dp_rank * tp + tp_rank; with Ulysses the file's ZeRO rank is
    data rank x seq + sequence rank, so the same formula holds)."""
    return ((dp_rank * tp + mp_rank % tp) // etp) % ep


def _without(mapping: dict, experts) -> dict:
    out = type(mapping)()
    for name, value in mapping.items():
        if name not in experts:
            out[name] = value
    return out


def _hide_experts(state: dict, experts) -> None:
    """A model-states record without the expert parameters' shapes and the universal patterns only they match."""
    shapes = state[C.PARAM_SHAPES]
    names = [name for group in shapes for name in group]
    state[C.PARAM_SHAPES] = [_without(group, experts) for group in shapes]
    info = state.get(C.UNIVERSAL_CHECKPOINT_INFO)
    if not info:
        return
    for key, patterns in list(info.items()):
        if isinstance(patterns, list) and all(isinstance(p, str) for p in patterns):
            info[key] = [p for p in patterns if any(re.match(p, name) for name in names if name not in experts)
                         or not any(re.match(p, name) for name in experts)]


def stage_expert_names(tag_dir: str, staging: str, config: ModelConfig, engine: str, ep: int, tp: int = 1,
                       etp: int = 0, seq: int = 1) -> None:
    """Write into ``staging`` the copy of ``tag_dir`` DeepSpeed's converter reads (see the module docstring).
    ``etp`` below ``tp``: the experts are whole on every TP rank and hidden from the converter. ``seq``: the
    sequence ranks (Ulysses') inside the ZeRO group, whose file index r is then data rank x seq + sequence rank."""
    experts = expert_folders(config, engine)
    whole = 0 < etp < tp
    os.makedirs(staging)
    for name in sorted(os.listdir(tag_dir)):
        source, target = os.path.join(tag_dir, name), os.path.join(staging, name)
        optim = _OPTIM_FILE.search(name)
        if optim is not None:
            state = _load(source)
            # ZeRO rank r (data rank r // seq) holds EP rank (r // seq) % EP's experts
            ep_rank = int(optim.group(1)) // seq % ep
            sd = state[C.OPTIMIZER_STATE_DICT]
            sd[C.PARAM_SLICE_MAPPINGS] = [_without(group, experts) if whole else _renamed(group, experts, [ep_rank])
                                          for group in sd[C.PARAM_SLICE_MAPPINGS]]
            torch.save(state, target)
        elif fnmatch.fnmatch(name, _MODEL_STATES):
            state = _load(source)
            if whole:
                _hide_experts(state, experts)
            else:
                state[C.PARAM_SHAPES] = [_renamed(group, experts, range(ep)) for group in state[C.PARAM_SHAPES]]
            torch.save(state, target)
        else:
            os.symlink(os.path.abspath(source), target)


def extract_whole_experts(tag_dir: str, zero_dir: str, config: ModelConfig, engine: str, ep: int, tp: int,
                          etp: int) -> int:
    """With experts whole over TP (``etp`` < ``tp``): every EP rank's expert parameters, cut from the optimizer
    files' flat partitions (its data-parallel ranks' fragments in order), into ``zero_dir/epNN.name/{state}.pt``
    (and step.pt) as DeepSpeed's converter writes a merged parameter; the number of folders written."""
    experts = expert_folders(config, engine)
    shapes: dict[tuple[int, str], torch.Size] = {}  # (mp rank, name) -> the expert tensor's shape there
    for path in sorted(glob.glob(os.path.join(tag_dir, _MODEL_STATES))):
        mp_rank = int(re.search(r"mp_rank_(\d+)_model_states", path).group(1))
        for group in _load(path)[C.PARAM_SHAPES]:
            shapes.update({(mp_rank, name): torch.Size(shape) for name, shape in group.items() if name in experts})
    pieces: dict[tuple[int, str], list] = {}  # (ep rank, name) -> [(dp rank, {state: flat fragment}, step)]
    for entry in sorted(os.listdir(tag_dir)):
        optim = _OPTIM_FILE.search(entry)
        if optim is None:
            continue
        dp_rank, mp_rank = int(optim.group(1)), int(optim.group(2))
        ep_rank = _whole_ep_rank(dp_rank, mp_rank, tp, ep, etp)
        sd = _load(os.path.join(tag_dir, entry))[C.OPTIMIZER_STATE_DICT]
        for group_id, mapping in enumerate(sd[C.PARAM_SLICE_MAPPINGS]):
            state = sd[C.BASE_OPTIMIZER_STATE]["state"][group_id]
            flat = {"fp32": sd[C.SINGLE_PARTITION_OF_FP32_GROUPS][group_id], "exp_avg": state["exp_avg"],
                    "exp_avg_sq": state["exp_avg_sq"]}
            for name, fragment in mapping.items():
                if name in experts:
                    cut = {key: t.narrow(0, fragment.start, fragment.numel).clone() for key, t in flat.items()}
                    pieces.setdefault((ep_rank, name), []).append((dp_rank, mp_rank, cut, state.get("step")))
    for (ep_rank, name), parts in sorted(pieces.items()):
        parts.sort(key=lambda part: part[0] * tp + part[1] % tp)  # stage-local rank order: the group's
        shape = shapes[(parts[0][1], name)]
        folder = os.path.join(zero_dir, EP_PREFIX.format(ep_rank) + name)
        os.makedirs(folder, exist_ok=True)
        for key in _STATES:
            tensor = torch.cat([part[2][key] for part in parts]).view(shape)
            torch.save({C.PARAM: tensor}, os.path.join(folder, f"{key}.pt"))
        if parts[0][3] is not None:
            torch.save(parts[0][3], os.path.join(folder, "step.pt"))
    return len(pieces)


def _state_file(path: str, param: ParameterLayout, ds_cat_dim: int, tp: int) -> dict:
    """One EP rank's merged state of ``param``, its TP slices joined along the parameter's own TP dim (DeepSpeed
    joined them along ``ds_cat_dim``: 1 for the row-parallel patterns, else 0)."""
    record = _load(path)
    record = dict(record) if isinstance(record, dict) else {C.PARAM: record}
    tensor = record[C.PARAM]
    if tp > 1 and param.partition_dim is not None and param.partition_dim != ds_cat_dim:
        tensor = torch.cat(tensor.chunk(tp, dim=ds_cat_dim), dim=param.partition_dim)
    record[C.PARAM] = tensor
    return record


def merge_expert_folders(zero_dir: str, config: ModelConfig, engine: str, ep: int, tp: int,
                         row_patterns: list[str]) -> int:
    """Join the EP ranks' folders of every expert parameter into its own folder (see the module docstring); the
    number of parameters written. ``row_patterns``: the universal info's row-parallel patterns (DeepSpeed's
    TP merge joined those along dim 1)."""
    num_experts = config.moe.num_experts
    experts = expert_folders(config, engine)
    for name, param in experts.items():
        sources = [os.path.join(zero_dir, EP_PREFIX.format(r) + name) for r in range(ep)] if ep > 1 else \
            [os.path.join(zero_dir, name)]
        ds_cat_dim = 1 if any(re.match(p, name) for p in row_patterns) else 0
        merged = {}
        for state in _STATES:
            records = [_state_file(os.path.join(src, f"{state}.pt"), param, ds_cat_dim, tp) for src in sources]
            tensor = torch.cat([r[C.PARAM] for r in records], dim=0)  # [E, ...]: EP rank 0's experts first
            if tensor.shape[0] != num_experts:
                raise ValueError(f"{sources[0]}: {tensor.shape[0]} experts merged from {ep} EP ranks, the model "
                                 f"has --num-experts {num_experts}")
            record = {C.PARAM: tensor, C.EP_IS_EXPERT_PARAM: True, C.EP_NUM_EXPERTS: num_experts}
            if param.partition_dim is not None:
                record[C.CAT_DIM] = param.partition_dim
            merged[state] = record
        step = os.path.join(sources[0], "step.pt")
        step_value = _load(step) if os.path.isfile(step) else None
        target = os.path.join(zero_dir, name)
        for src in sources + [target]:  # DeepSpeed may have written EP rank 0's weights under the bare name
            shutil.rmtree(src, ignore_errors=True)
        os.makedirs(target)
        for state, record in merged.items():
            torch.save(record, os.path.join(target, f"{state}.pt"))
        if step_value is not None:
            torch.save(step_value, os.path.join(target, "step.pt"))
    return len(experts)


def save_buffer_state(tag_dir: str, out_dir: str, config: ModelConfig, wanted, file_name: str) -> int:
    """Copy the buffers whose names ``wanted(name)`` accepts from the regular checkpoint ``tag_dir`` (the pipeline
    engine's layer files, or the model engine's model states) to ``out_dir/file_name``, by GPTModel module name;
    how many (0: none, no file). Such buffers are the same on every TP rank: the first file's are taken."""
    state = {}
    for item in pipeline_items(config):
        if item.layer_number is None:
            continue
        files = sorted(glob.glob(os.path.join(tag_dir, f"layer_{item.index:02d}-model_*-model_states.pt")))
        if files:
            state.update({item.prefix + key: t for key, t in _load(files[0]).items() if wanted(key)})
    if not state:
        for path in sorted(glob.glob(os.path.join(tag_dir, _MODEL_STATES)))[:1]:
            module = _load(path).get("module") or {}
            state = {name: t for name, t in module.items() if wanted(name)}
    if state:
        torch.save(state, os.path.join(out_dir, file_name))
    # DeepSpeed's converter writes a zero/ folder for every entry of a model-engine checkpoint's module state that
    # has no optimizer fragment, buffers included: these live in file_name, not among the parameters
    for name in state:
        shutil.rmtree(os.path.join(out_dir, "zero", name), ignore_errors=True)
    return len(state)


def save_router_state(tag_dir: str, out_dir: str, config: ModelConfig) -> int:
    """The routers' expert biases to ``ROUTER_STATE_FILE`` (``save_buffer_state``); how many."""
    return save_buffer_state(tag_dir, out_dir, config, lambda name: name.endswith(ROUTER_BUFFER), ROUTER_STATE_FILE)


def save_fp8_state(tag_dir: str, out_dir: str, config: ModelConfig) -> int:
    """FP8 delayed scaling's amax histories and scales to ``FP8_STATE_FILE`` (``save_buffer_state``); how many."""
    return save_buffer_state(tag_dir, out_dir, config, is_fp8_state_key, FP8_STATE_FILE)

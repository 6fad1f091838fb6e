"""Every workaround for how the installed DeepSpeed behaves, in one place, each checked against its version.

The project pins DeepSpeed ``PINNED_VERSION`` (the Makefile's ``DEEPSPEED_VERSION``). What follows was
measured on deepspeed 0.19.8 with torch 2.13 on CPU; each workaround calls ``require(name)`` before it
acts, which raises a RuntimeError naming the pinned and the installed version and what to re-check when
they differ (an upgrade then fails at the first workaround it reaches, not silently later).

    name (WORKAROUNDS)        what deepspeed 0.19.8 does                    what answers it
    bf16_stage_0              bf16 + ZeRO stage 0 + fp32 gradient           ``--bf16 --zero-stage 0`` runs as stage 1
                              accumulation is NotImplemented; BLOOM's        (``megatron.config.run.deepspeed_zero_stage``,
                              BF16_Optimizer comes from stage 1              a pure rule; checked by ``build_engine``)
    universal_optimizer       ZeRO-3's universal loader gives every          ``checkpoint_loading`` restores this run's
                              parameter group the first group's              hyperparameters and a step tensor per
                              hyperparameters and one shared step tensor     group (``mend_universal_optimizer``)
    universal_tp_restore      ZeRO-3's universal loader partitions full      ``universal_tp_restore``: AutoTP's restore
                              tensors over DP only (fails at TP > 1)         record and DeepSpeed's private TP group
    unsafe_torch_load         its checkpoint engine, universal converter     ``use_safe_loading``: a checkpoint engine
                              and loader call torch.load(weights_only=       that loads weights-only; ``safe_loading``:
                              False): a crafted pickle would run             every torch.load weights-only while the
                                                                             converter and universal loaders run
    muon_import               its ZeRO support check and optimizers         ``skip_unused_muon_import``: stand-in
                              import its Muon optimizer module, its ZeRO    modules, a class no optimizer here is
                              stages and BF16_Optimizer its Muon math       and math never called (its Muon is never
                              (whose @torch.compile decorators import       used: the JSON's optimizer section is
                              inductor: 1.6-3 s of CPU per rank, every      refused, no parameter is ``use_muon``)
                              launch)
    shm_comm_build            builds its shared-memory comm op (~35 s of     ``avoid_cpu_jit_builds`` marks it
                              JIT C++) on the CPU accelerator, used by       incompatible: gloo carries every
                              inference all-reduce only                      collective
    hpz_group                 builds hpZ groups from consecutive world       ``set_zero_param_intra_group``: its private
                              ranks (TP peers in one group)                  module-level group, set before initialize
    zero3_init_dtype          ``zero.Init(dtype=...)`` on CPU makes bf16     ``zero3_init`` leaves ``dtype`` out
                              whatever it is given
    renamed_collectives       ZeRO-2/3 call all_gather_into_tensor /         ``silence_renamed_collectives``: exactly
                              reduce_scatter_tensor, which torch 2.13        those two FutureWarnings
                              deprecated (a warning per rank per call)
    zero3_ulysses_average     ZeRO-3's reduce-scatter (``reduce_scatter:     ``megatron.engine.ulysses.backward_loss_scale``
                              true``) averages over dp x sp ranks, the       multiplies the loss by sp (checked by
                              other stages over dp                           ``ModelEngine``)
    expert_parallel           turns on its MoE paths (expert gradients       ``register_expert_groups`` fills its private
                              over the expert-data-parallel group, ZeRO-1    group registries; ``mark_moe_parameter`` marks
                              shards per group, the grad norm summed over    a parameter as its MoE's are;
                              the expert group) only for parameters marked   ``ExpertParallelMarker`` (``moe_marker``), a
                              ``allreduce=False`` + ``group_name`` whose     parameter-free MoE subclass, makes the engine
                              groups sit in ``groups._EXPERT_*`` and only    set ``has_moe_layers``; ``check_moe_engine``
                              when it finds a ``deepspeed.moe.layer.MoE``    asserts it did
                              module before it builds the optimizer
    expert_tp_grad_norm       BF16_Optimizer sums the experts' grad norm    ``register_expert_groups`` sets its expert
                              over TP only when its private expert-TP       TP size; ``count_expert_grads_once`` drops
                              size is > 1, and counts every expert          a TP-duplicated expert gradient from the
                              parameter on every TP rank (a TP-duplicated   norm on TP ranks > 0
                              expert bias twice at TP = 2)
    universal_expert_slicing  its universal loader cuts an expert tensor    ``universal_expert_slicing``: for the load,
                              to this EP rank's experts from the group      the registry holds only this run's EP group,
                              registry, parsing ``ep_size_N`` names         under DeepSpeed's name (none at EP = 1)
    pipeline_engine_class     ``deepspeed.initialize`` builds PipelineEngine  ``pipeline_engine_class``: our engine class
                              (or DualPipeVEngine) for any PipelineModule,  in that module global while initialize runs
                              read from a module global of ``deepspeed``    (interleaved virtual stages)
    moe_checkpoint            with ``has_moe_layers`` it saves and loads    ``plain_checkpoint_files``: its regular files
                              its own MoE's per-expert files (found by      while it saves and loads; our experts go to
                              module type), which our marker holds none of  files of their own (``megatron.engine.
                                                                            expert_parallel``)
    zero3_module_outputs      ZeRO-3 gathers a module's parameters for    ``zero3_leaf_modules``: each MoE layer is one
                              its backward from a hook on the tensors of   ZeRO-3 leaf module (DeepSpeed's mechanism for
                              its output (tuples, lists, dicts); the MoE   MoE blocks), gathered whole at its own hooks,
                              router returns a ``Routing``, so its         on the layer's output tensor
                              weight stayed partitioned in the backward
    pipeline_schedule         PipelineEngine runs only its TrainSchedule    ``pipeline_engine_class`` builds our
                              (1F1B); no hook for another schedule, for     subclass that overrides its private
                              new instructions or for virtual stages;       schedule methods (megatron.engine.
                              PipelineModule builds one stage per rank      schedules: ZB-H1, interleaved; the
                                                                            interleaved module overrides its private
                                                                            partition and build methods); each
                                                                            class requires this workaround when it
                                                                            is constructed; the overridden methods:
                                                                            ``PIPELINE_SCHEDULE_OVERRIDES``

Models of DeepSpeed's behaviour outside this package, which cannot import it, re-measured against the real
thing by their tests rather than checked here: the planner's ZeRO communication counts and defaults
(``megatron.planner.comm_zero``, tests/planner/test_comm_zero.py), its memory model (``planner.memory``,
tests/planner/test_memory_measured.py), the pipeline partition rule (``megatron.parallel.pipeline_partition``,
tests/engine/test_partition.py) and the engine-per-ZeRO-stage rule (``megatron.config.run.deepspeed_engine_for``).
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from typing import Iterator

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from torch import nn

from megatron.checkpoint.safe_load import only_safe_loading, safe_load
from megatron.checkpoint.zero_files import DEEPSPEED_GLOBALS

__all__ = ["PINNED_VERSION", "WORKAROUNDS", "require", "installed_version", "checkpoint_loading", "safe_loading",
           "mend_universal_optimizer", "universal_tp_restore", "set_zero_param_intra_group", "zero3_init", "zero3_leaf_modules",
           "silence_renamed_collectives", "check_bf16_stage_0", "check_zero3_ulysses", "DEEPSPEED_GLOBALS",
           "SafeTorchCheckpointEngine", "use_safe_loading", "avoid_cpu_jit_builds", "skip_unused_muon_import",
           "ExpertParallelMarker", "moe_marker", "register_expert_groups", "mark_moe_parameter", "is_moe_parameter",
           "check_moe_engine", "count_expert_grads_once", "plain_checkpoint_files", "universal_expert_slicing",
           "pipeline_engine_class", "PIPELINE_SCHEDULE_OVERRIDES"]

PINNED_VERSION = "0.19.8"

# DeepSpeed class -> its private methods (and class attributes) the schedule engines of megatron.engine.schedules
# override (tests/engine/test_deepspeed_compat.py checks the list is whole)
PIPELINE_SCHEDULE_OVERRIDES = {
    "PipelineEngine": ("_train_schedule", "_inference_schedule", "_exec_schedule", "_INSTRUCTION_MAP",
                       "_exec_load_micro_batch", "_exec_forward_pass", "_exec_backward_pass", "_exec_send_activations",
                       "_exec_recv_activations", "_exec_send_grads", "_exec_recv_grads", "_exec_reduce_tied_grads"),
    "PipelineModule": ("_partition_layers", "_build", "_precompute_checkpointable_values"),
}

# name -> what to re-check on another DeepSpeed version
WORKAROUNDS = {
    "bf16_stage_0": "whether bf16 + ZeRO-0 + fp32 grad accumulation initializes, and which optimizer stage 1 builds "
                    "(tests/engine/test_optimizer.py asserts BF16_Optimizer)",
    "universal_optimizer": "ZeRO-3's universal loader's parameter-group hyperparameters and step tensors "
                           "(tests/training/test_universal_zero3_3d.py)",
    "universal_tp_restore": "deepspeed.checkpoint.constants.DS_AUTOTP_UC_META and groups._TENSOR_MODEL_PARALLEL_GROUP "
                            "in the ZeRO-3 universal loader (tests/training/test_universal_zero3_3d.py)",
    "unsafe_torch_load": "the torch.load calls of DeepSpeed's checkpoint engine, ds_to_universal and universal loaders "
                         "(tests/checkpoint/test_safe_load.py, tests/training/test_corrupt_checkpoints.py)",
    "muon_import": "where DeepSpeed imports deepspeed.runtime.zero.muon.muon_optimizer (is_zero_supported_optimizer, "
                   "BF16_Optimizer, the ZeRO stages: isinstance checks of MuonWithAuxAdam only) and "
                   "deepspeed.runtime.zero.muon.original_muon (muon_update: only for use_muon parameters), and "
                   "whether anything else of those modules is used",
    "shm_comm_build": "deepspeed.ops.__compatible_ops__ and the CPU accelerator's ShareMemCommBuilder (a fresh "
                      "machine's first launch must not spend ~35 s compiling)",
    "hpz_group": "deepspeed.utils.groups._ZERO_PARAM_INTRA_PARALLEL_GROUP and how zero_hpz_partition_size builds "
                 "its groups (tests/training/test_zero_sharding.py)",
    "zero3_init_dtype": "zero.Init's dtype handling on the CPU accelerator (tests/training/test_zero_sharding.py)",
    "renamed_collectives": "whether ZeRO-2/3 still call torch.distributed.all_gather_into_tensor / "
                           "reduce_scatter_tensor",
    "expert_parallel": "deepspeed.utils.groups._EXPERT_PARALLEL_GROUP / _EXPERT_DATA_PARALLEL_GROUP, "
                       "deepspeed.moe.utils.is_moe_param, and how the engine sets has_moe_layers (an isinstance scan "
                       "for deepspeed.moe.layer.MoE in _configure_distributed_model) "
                       "(tests/engine/test_deepspeed_compat.py, tests/training/test_moe.py)",
    "expert_tp_grad_norm": "groups.expert_tensor_parallel_world_size in get_global_norm_of_tensors and "
                           "BF16_Optimizer.get_grads_for_norm's expert filter (tests/training/test_moe.py compares "
                           "the bf16 grad norm at EP = 2 x TP = 2 with one process's)",
    "universal_expert_slicing": "base_optimizer._get_universal_checkpoint_ep_info (the EP rank and size from "
                                "groups._EXPERT_PARALLEL_GROUP's 'ep_size_N' names) and load_hp_checkpoint_state's "
                                "EP_IS_EXPERT_PARAM slicing (tests/training/test_moe.py resumes a universal MoE "
                                "checkpoint)",
    "moe_checkpoint": "how save_checkpoint / _load_checkpoint branch on has_moe_layers (the MoE path wants "
                      "deepspeed.moe.layer.MoE's experts) (tests/training/test_moe.py resumes EP runs)",
    "pipeline_engine_class": "how deepspeed.initialize picks the pipeline engine class (the module global "
                             "PipelineEngine) (tests/training/test_interleaved.py, tests/training/test_zero_bubble.py)",
    "zero3_ulysses_average": "the divisor of ZeRO-3's reduce-scatter with sequence parallelism "
                             "(tests/training/test_ulysses.py compares grad norms with a single process)",
    "zero3_module_outputs": "how ZeRO-3's parameter offload hooks find a module's output tensors "
                            "(apply_to_tensors_only) and treat a z3 leaf module (set_z3_leaf_modules) "
                            "(tests/training/test_moe_schedules.py trains MoE under ZeRO-3 and hpZ)",
    "pipeline_schedule": "the private methods megatron.engine.schedules overrides: "
                         + "; ".join(f"{cls} {', '.join(names)}" for cls, names in PIPELINE_SCHEDULE_OVERRIDES.items())
                         + "; the state they read (PipelineEngine's pipe_buffers, grad_layer, _reserve_pipe_buffers, "
                         "is_pipe_partitioned / is_grad_partitioned, DTYPE_TO_ID; PipelineModule's parts, "
                         "forward_funcs, _set_bounds, _local_start / _local_stop), TrainSchedule's step order, "
                         "BF16_Optimizer.clear_lp_grads / update_hp_grads (tests/training/test_zero_bubble.py trains "
                         "ZB-H1 against 1F1B, tests/training/test_interleaved.py interleaved)",
}


def installed_version() -> str:
    """The installed DeepSpeed's release, without a local build suffix ("0.19.8+abc" -> "0.19.8")."""
    return deepspeed.__version__.split("+")[0]


def require(name: str) -> None:
    """RuntimeError unless the installed DeepSpeed is the version workaround ``name`` was written for."""
    if name not in WORKAROUNDS:
        raise AssertionError(f"no DeepSpeed workaround named {name!r} (known: {', '.join(WORKAROUNDS)})")
    installed = installed_version()
    if installed != PINNED_VERSION:
        raise RuntimeError(f"deepspeed {installed} is installed, but the workaround {name!r} "
                           f"(megatron/engine/deepspeed_compat.py) was written for deepspeed {PINNED_VERSION}, the "
                           f"Makefile's pin. Re-check {WORKAROUNDS[name]}; then update or drop the workaround and "
                           f"PINNED_VERSION, or reinstall the pinned deepspeed=={PINNED_VERSION} (make clean-venv venv)")


def safe_loading():
    """Within: every torch.load of the process is weights-only with DeepSpeed's own classes allowed, whatever
    DeepSpeed's converter and loaders ask for (they ask for weights_only=False)."""
    require("unsafe_torch_load")
    return only_safe_loading(DEEPSPEED_GLOBALS)


class SafeTorchCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine with ``load`` through ``megatron.checkpoint.safe_load`` (tensors,
    containers, numpy's RNG state, Megatron's args, and ``DEEPSPEED_GLOBALS``): --load never unpickles code.
    It also reads checkpoints bigscience's Megatron-DeepSpeed wrote (their enums read as stand-ins)."""

    def load(self, path: str, map_location=None):
        return safe_load(path, extra_globals=DEEPSPEED_GLOBALS, map_location=map_location)


def use_safe_loading(engine) -> None:
    """Give ``engine`` (after ``deepspeed.initialize``) the safe-loading checkpoint engine in place of DeepSpeed's."""
    require("unsafe_torch_load")
    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ValueError(f"DeepSpeed chose the checkpoint engine {type(engine.checkpoint_engine).__name__}; only its "
                         f"torch engine is supported here (remove the checkpoint engine settings from the JSON)")
    engine.checkpoint_engine = SafeTorchCheckpointEngine(engine._config)


def avoid_cpu_jit_builds() -> None:
    """On the CPU accelerator, mark DeepSpeed's shared-memory comm op unavailable so that it is never built."""
    if get_accelerator().device_name() != "cpu":
        return
    require("shm_comm_build")
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


_DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"
_DEEPSPEED_MUON_MATH = "deepspeed.runtime.zero.muon.original_muon"


def skip_unused_muon_import() -> None:
    """Before any engine is built: DeepSpeed's ZeRO support check and its optimizers import its Muon optimizer module
    only to test ``isinstance(optimizer, MuonWithAuxAdam)``, and ZeRO-1/2's gradient partitioning, ZeRO-3 and
    BF16_Optimizer import its Muon math (``muon_update``) on every step, called only for parameters marked
    ``use_muon`` under its Muon optimizer. Both imports pull in inductor (the math's @torch.compile decorators):
    1.6-3 s of CPU per rank at every launch. This engine never hands DeepSpeed its Muon (the JSON's optimizer section
    is refused; ``--optimizer muon`` is ``megatron.engine.muon``, which marks no parameter ``use_muon``), so stand-in
    modules answer as the real ones would: a class no optimizer is an instance of, and math that says it is not
    available if ever called. Nothing is done for a module already imported."""
    require("muon_import")

    def unavailable(*args, **kwargs):
        raise RuntimeError("DeepSpeed's own Muon optimizer is not available in this engine: use --optimizer muon "
                           "(megatron.engine.muon)")

    class MuonWithAuxAdam:
        """DeepSpeed's Muon optimizer, never used by this engine (no optimizer is an instance of this)."""

        __init__ = unavailable

    doc = "a stand-in: megatron.engine.deepspeed_compat.skip_unused_muon_import"
    for name, attributes in ((_DEEPSPEED_MUON, {"MuonWithAuxAdam": MuonWithAuxAdam}),
                             (_DEEPSPEED_MUON_MATH, {"MuonWithAuxAdam": MuonWithAuxAdam, "muon_update": unavailable,
                                                     "adam_update": unavailable})):
        if name not in sys.modules:
            stand_in = types.ModuleType(name, doc)
            stand_in.__dict__.update(attributes)
            sys.modules[name] = stand_in


def mend_universal_optimizer(optimizer, own_groups: list[dict]) -> None:
    """After a universal load: every parameter group gets back this run's hyperparameters (``own_groups``; the
    learning rate is the scheduler's) and a step tensor of its own, which Adam would otherwise count up once per
    group per step."""
    require("universal_optimizer")
    for group, own in zip(optimizer.param_groups, own_groups, strict=True):
        group.update(own)
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside DeepSpeed's ZeRO wrapper
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


@contextlib.contextmanager
def checkpoint_loading(engine, universal: bool) -> Iterator[None]:
    """The context DeepSpeed's ``load_checkpoint`` runs in (``megatron.checkpoint.resume.restore``'s
    ``loading``): safe unpickling, and for a universal checkpoint the ZeRO-3 TP restore (``engine``'s
    ``universal_tp_restore``, megatron.engine.model_engine) and the optimizer mended after the load."""
    own_groups = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    tp_restore = getattr(engine, "universal_tp_restore", None) if universal else None
    with safe_loading(), (tp_restore() if tp_restore else contextlib.nullcontext()), \
            (universal_expert_slicing(engine) if universal else contextlib.nullcontext()):
        yield
    if universal:
        mend_universal_optimizer(engine.optimizer, own_groups)


@contextlib.contextmanager
def universal_expert_slicing(engine) -> Iterator[None]:
    """Within: DeepSpeed's ZeRO-1/2 universal loader cuts this EP rank's experts (dim 0) out of an expert
    folder's ``[E, ...]`` tensors (``megatron.checkpoint.universal.expert_folders``), asking its expert-group registry for
    the EP rank and size: it parses the size from a group named ``ep_size_N`` (ours is named
    ``megatron_ep_size_N``, and fails to parse), and with no group it slices nothing (EP = 1). So the registry
    holds, for the load only, this run's expert-parallel group under DeepSpeed's name, or nothing."""
    require("universal_expert_slicing")
    from deepspeed.utils import groups  # noqa: PLC0415 (private DeepSpeed state, imported only after require() checked the version)

    names = {group["name"] for group in engine.optimizer.param_groups if group.get("moe")}
    registry = groups._EXPERT_PARALLEL_GROUP
    ours = {f"ep_size_{torch.distributed.get_world_size(registry[name])}": registry[name] for name in names}
    groups._EXPERT_PARALLEL_GROUP = ours
    try:
        yield
    finally:
        groups._EXPERT_PARALLEL_GROUP = registry


@contextlib.contextmanager
def universal_tp_restore(params: list, tp: int, tp_group) -> Iterator[None]:
    """Within: ZeRO-3's universal loader cuts each full tensor to this rank's TP slice before partitioning it
    over DP. It does so for parameters carrying AutoTP's restore record (the split dim and full shape, or
    replicated) with DeepSpeed's tensor-parallel group set; both are given for the load only."""
    require("universal_tp_restore")
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META  # noqa: PLC0415 (private DeepSpeed state, imported only after require() checked the version)
    from deepspeed.utils import groups  # noqa: PLC0415 (private DeepSpeed state, imported only after require() checked the version)

    for param in params:
        shape = list(param.ds_shape)  # this TP rank's slice
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= tp
            setattr(param, DS_AUTOTP_UC_META, {"partition_dim": param.partition_dim, "logical_shape": tuple(shape)})
        else:
            setattr(param, DS_AUTOTP_UC_META, {"replicated": True})
    saved = groups._TENSOR_MODEL_PARALLEL_GROUP
    groups._TENSOR_MODEL_PARALLEL_GROUP = tp_group
    try:
        yield
    finally:
        groups._TENSOR_MODEL_PARALLEL_GROUP = saved
        for param in params:
            delattr(param, DS_AUTOTP_UC_META)


def set_zero_param_intra_group(group) -> None:
    """Give DeepSpeed the hpZ group (None: no hpZ). DeepSpeed uses a group already set in its module-level state
    instead of building one from consecutive world ranks (which with TP > 1 would mix TP peers holding
    different slices); set anew by each run, since several runs may share one process."""
    require("hpz_group")
    from deepspeed.utils import groups  # noqa: PLC0415 (private DeepSpeed state, imported only after require() checked the version)

    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group


def zero3_init(data_parallel_group, config: dict, mpu):
    """``deepspeed.zero.Init`` partitioning over ``data_parallel_group``, with the hpZ group set above.

    Inside, torch.empty / zeros / tensor / ... make tensors of the config's dtype (bf16 with --bf16, else fp32);
    the few that must stay fp32 are made with megatron.parallel.utils.fp32_empty / fp32_tensor. ``dtype`` is left
    out: on CPU, DeepSpeed would pick bf16 whatever it is given. The config's
    zero_optimization.memory_efficient_linear is false (megatron.config.deepspeed): it would replace
    torch.nn.functional.linear for the whole process."""
    require("zero3_init_dtype")
    from deepspeed.utils import groups  # noqa: PLC0415 (private DeepSpeed state, imported only after require() checked the version)

    return deepspeed.zero.Init(data_parallel_group=data_parallel_group, config_dict_or_path=config, mpu=mpu,
                               zero_param_parallel_group=groups._get_zero_param_intra_parallel_group())


def zero3_leaf_modules(model: torch.nn.Module, classes: list) -> None:
    """Make every module of ``classes`` below ``model`` a ZeRO-3 leaf: its parameters (its sub-modules' too) are
    gathered before its forward and again before its backward from hooks on its own output tensors. Before
    ``deepspeed.initialize``, which installs the hooks."""
    require("zero3_module_outputs")
    deepspeed.utils.set_z3_leaf_modules(model, classes)


def silence_renamed_collectives() -> None:
    """ZeRO-2/3 call torch.distributed.all_gather_into_tensor / reduce_scatter_tensor, which torch renamed
    (*_single, the same collectives): the FutureWarning, repeated by every rank, says nothing a user can act
    on. Exactly those two are silenced."""
    require("renamed_collectives")
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def check_bf16_stage_0(zero_stage: int, bf16: bool) -> None:
    """``--bf16 --zero-stage 0`` runs as stage 1 (``megatron.config.run.deepspeed_zero_stage``): true of this
    DeepSpeed only."""
    if bf16 and zero_stage == 0:
        require("bf16_stage_0")


def check_zero3_ulysses(zero_stage: int, sp_size: int) -> None:
    """ZeRO-3 with DeepSpeed-Ulysses scales the loss by sp (``megatron.engine.ulysses.backward_loss_scale``)."""
    if zero_stage == 3 and sp_size > 1:
        require("zero3_ulysses_average")


class ExpertParallelMarker(DeepSpeedMoE):
    """Makes DeepSpeed's engine see a model with MoE layers (``has_moe_layers``), for its expert-parallel paths to
    act on our expert parameters. Holds nothing and is never called: ``deepspeed.moe.layer.MoE.__init__`` (which
    would build DeepSpeed's own experts and groups) is skipped. Made by ``moe_marker``."""

    def __init__(self, num_experts: int, group_name: str):
        nn.Module.__init__(self)
        self.num_experts, self.expert_group_name = num_experts, group_name

    def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
        """The engine asks each MoE to create its groups: ours are registered (``register_expert_groups``)."""

    def forward(self, *inputs):
        raise AssertionError("ExpertParallelMarker is a marker for DeepSpeed's engine, not a layer")


def moe_marker(num_experts: int, group_name: str) -> ExpertParallelMarker:
    """The marker to add to the model before ``deepspeed.initialize`` (see ``ExpertParallelMarker``)."""
    require("expert_parallel")
    return ExpertParallelMarker(num_experts, group_name)


def register_expert_groups(group_name: str, ep_group, expert_data_group, tp_size: int = 1) -> None:
    """Register our expert-parallel and expert-data-parallel groups in DeepSpeed's private registries under
    ``group_name``, where its engine and ZeRO-1 / BF16_Optimizer look them up; and that the experts are split over
    ``tp_size`` TP ranks (BF16_Optimizer then sums their grad norm over the model-parallel group, as for dense
    TP-split parameters; set anew by each run, since several runs may share one process)."""
    require("expert_parallel")
    require("expert_tp_grad_norm")
    from deepspeed.utils import groups  # noqa: PLC0415 (private DeepSpeed state, imported only after require() checked the version)

    groups._EXPERT_PARALLEL_GROUP[group_name] = ep_group
    groups._EXPERT_DATA_PARALLEL_GROUP[group_name] = expert_data_group
    groups.expert_tensor_parallel_world_size = tp_size


def mark_moe_parameter(param: torch.Tensor, group_name: str) -> None:
    """Mark ``param`` as DeepSpeed marks its MoE's expert parameters: reduced over ``group_name``'s groups."""
    require("expert_parallel")
    param.allreduce = False
    param.group_name = group_name


def is_moe_parameter(param: torch.Tensor) -> bool:
    """Whether DeepSpeed treats ``param`` as an expert parameter (``mark_moe_parameter``)."""
    return is_moe_param(param)


def check_moe_engine(engine, group_name: str) -> None:
    """After ``deepspeed.initialize``: the engine found the marker and holds our expert-data-parallel group."""
    require("expert_parallel")
    from deepspeed.utils import groups  # noqa: PLC0415 (private DeepSpeed state, imported only after require() checked the version)

    if not (engine.has_moe_layers and engine.expert_data_parallel_group.get(group_name) is
            groups._EXPERT_DATA_PARALLEL_GROUP[group_name]):
        raise RuntimeError(f"DeepSpeed's engine did not take up the expert-parallel groups {group_name!r}: re-check "
                           f"{WORKAROUNDS['expert_parallel']}")


def count_expert_grads_once(optimizer, tp_rank: int) -> None:
    """BF16_Optimizer ``optimizer``'s grad norm counts a TP-duplicated expert parameter (an expert's output bias)
    on TP rank 0 only, as it does a dense one: its ``get_grads_for_norm`` counts every expert parameter on every TP
    rank. No-op for other optimizers (DeepSpeedZeroOptimizer and our fp32 clipper count each once already)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: PLC0415 (private DeepSpeed class, imported only where the workaround applies)
    from deepspeed.runtime.utils import is_model_parallel_parameter  # noqa: PLC0415 (same)

    if not isinstance(optimizer, BF16_Optimizer) or tp_rank == 0:
        return
    require("expert_tp_grad_norm")
    duplicated = {id(optimizer.fp32_groups_gradients[i][j]) for i, group in enumerate(optimizer.bf16_groups)
                  for j, param in enumerate(group) if is_moe_param(param) and not is_model_parallel_parameter(param)}
    counted = optimizer.get_grads_for_norm

    def get_grads_for_norm(for_clipping=False):
        if for_clipping:
            return counted(for_clipping=True)
        dense, experts = counted()
        return dense, {name: [g for g in grads if id(g) not in duplicated] for name, grads in experts.items()}

    optimizer.get_grads_for_norm = get_grads_for_norm


@contextlib.contextmanager
def plain_checkpoint_files(engine) -> Iterator[None]:
    """Within: ``engine`` (with our MoE marker) saves and loads its regular files, as without MoE; the caller
    saves and loads the experts itself."""
    require("moe_checkpoint")
    had_moe = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = had_moe


@contextlib.contextmanager
def pipeline_engine_class(engine_class) -> Iterator[None]:
    """Within: ``deepspeed.initialize`` builds ``engine_class`` (a PipelineEngine subclass) for a PipelineModule."""
    require("pipeline_engine_class")
    original = deepspeed.PipelineEngine
    deepspeed.PipelineEngine = engine_class
    try:
        yield
    finally:
        deepspeed.PipelineEngine = original

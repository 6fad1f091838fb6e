"""--torch-compile: each transformer layer compiled on its own (``nn.Module.compile``, in place).

Compiling layer by layer, not the whole model, keeps what the rest of the project relies on: the pipeline
engine still stages the same modules, parameter names and state-dict keys are unchanged (no ``_orig_mod.``
prefix), activation checkpointing recomputes a layer by calling it again, and tensor-parallel collectives
stay between compiled regions. Inductor fuses what BLOOM had hand-written CUDA kernels for (bias + GeLU,
bias + dropout + residual, LayerNorm). Layers of one shape share one compiled graph (torch inlines module
parameters as inputs). Compilation happens at the first forward and backward.

A layer whose MLP is a mixture of experts (``MoELayer``) is compiled by region: its dense parts (the two norms,
the attention, the shared expert) each compiled, the router, the token dispatch and the experts left eager.
Those decide shapes from data (how many rows each expert gets: host reads such as ``.tolist()`` in
``moe.dispatch.plan_dispatch``, the experts' padded capacity), so a compiled graph would break there and be
specialised again on every new count; the residual additions between the regions run eager too.
"""

from __future__ import annotations

from torch import nn

from megatron.model.moe import MoELayer
from megatron.model.transformer import TransformerLayer

__all__ = ["compile_transformer_layers", "compiled_regions"]


def compiled_regions(layer: TransformerLayer) -> list[nn.Module]:
    """What ``compile_transformer_layers`` compiles of ``layer``: the layer itself, or for an MoE layer its dense
    parts (norms, attention, the shared expert where it has one)."""
    if not isinstance(layer.mlp, MoELayer):
        return [layer]
    regions = [layer.input_layernorm, layer.self_attention, layer.post_attention_layernorm]
    return regions + ([layer.mlp.shared_expert] if layer.mlp.shared_expert is not None else [])


def compile_transformer_layers(module: nn.Module) -> int:
    """Compile every TransformerLayer below ``module`` in place (an MoE layer by region: ``compiled_regions``);
    return how many layers. (On CPU, inductor needs a C++ compiler: ``megatron.engine.cpu.check_cpu_compiler``
    says so before this runs.)"""
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        for region in compiled_regions(layer):
            region.compile()
    return len(layers)

"""--torch-compile: each transformer layer compiled on its own (``nn.Module.compile``, in place).

Compiling layer by layer, not the whole model, keeps what the rest of the project relies on: the pipeline
engine still stages the same modules, parameter names and state-dict keys are unchanged (no ``_orig_mod.``
prefix), activation checkpointing recomputes a layer by calling it again, and tensor-parallel collectives
stay between compiled regions. Inductor fuses what BLOOM had hand-written CUDA kernels for (bias + GeLU,
bias + dropout + residual, LayerNorm). Layers of one shape share one compiled graph (torch inlines module
parameters as inputs). Compilation happens at the first forward and backward.
"""

from __future__ import annotations

from torch import nn

from megatron.model.transformer import TransformerLayer

__all__ = ["compile_transformer_layers"]


def compile_transformer_layers(module: nn.Module) -> int:
    """Compile every TransformerLayer below ``module`` in place; return how many. (On CPU, inductor needs a C++
    compiler: ``megatron.engine.cpu.check_cpu_compiler`` says so before this runs.)"""
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)

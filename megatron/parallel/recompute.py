"""Recomputing a part of a layer in backward (--recompute-modules): the part's output is dropped from memory
once its consumers have run, and rebuilt from the part's kept inputs just before the consumers' backward.

    y = part(x)                       its graph dropped at once: only x is kept (the part's intermediates are not)
    z = consumer(y)                   the consumer saves y (or views of it) for its backward, as usual
    discard(z)                        y's storage is freed; a hook on z's gradient recomputes part(x) with a
                                      graph, copies the result into y's storage and backpropagates through it

This is Megatron-LM's CheckpointWithoutOutput, written here: a plain checkpoint of ``part`` alone would keep y
anyway (the consumer saves it). The copy goes storage to storage, so the version counters of the tensors the
consumer saved do not move (autograd would reject an in-place write). Consumers may keep y by reference
(another checkpoint's input, a deferred weight gradient of ZB-H1): the storage is the same, rebuilt before any
backward that reads it. A consumer that copies y (an all-gather, an FP8 quantization) keeps its copy: correct,
only less is freed. ``part`` must draw no random numbers (norms, activations, projections) and must not
return a view of an input.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["OutputDiscardingCheckpoint", "recompute_enabled"]


def recompute_enabled(module: torch.nn.Module) -> bool:
    """Whether a module's forward builds a graph that a backward will use (training with grad enabled)."""
    return module.training and torch.is_grad_enabled()


class _Part(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner, *inputs):
        ctx.owner, owner.ctx = owner, ctx
        ctx.save_for_backward(*inputs)  # through saved-tensor hooks: an enclosing checkpoint keeps none of them
        # with a graph (dropped at once), as the rebuild runs it: some kernels differ without one (F.rms_norm's
        # fused path), and the backward must see the values the forward used
        with torch.enable_grad():
            outputs = owner.run(*(x.detach().requires_grad_(x.requires_grad) for x in inputs))
        if isinstance(outputs, torch.Tensor):
            return outputs.detach()
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        owner = ctx.owner
        if owner.graph is None:  # the output was not discarded: no hook rebuilt it
            owner.rebuild()
        outputs, inputs = owner.graph
        owner.graph, owner.ctx, owner.outputs = None, None, ()
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(x.grad if x.requires_grad else None for x in inputs))


class OutputDiscardingCheckpoint:
    """One recomputed part: ``y = ckpt(part, *inputs)`` (tensors), then after its consumers
    ``ckpt.discard(consumer_output)``. One object per forward of the part."""

    def __init__(self) -> None:
        self.run: Optional[Callable] = None
        self.ctx = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.graph = None

    def __call__(self, part: Callable, *inputs: torch.Tensor):
        self.run, self.graph = part, None
        self.input_storages = {x.untyped_storage().data_ptr() for x in inputs}
        out = _Part.apply(self, *inputs)
        self.outputs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        return out

    def rebuild(self) -> None:
        """Run the part again with a graph, on detached aliases of the kept inputs, and copy the result into the
        discarded outputs' storages (storage to storage: no version counter moves)."""
        inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in self.ctx.saved_tensors)
        with torch.enable_grad():
            outputs = self.run(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        with torch.no_grad():
            done = set()
            for kept, new in zip(self.outputs, outputs):
                storage = kept.untyped_storage()
                if storage.size() == 0:
                    storage.resize_(new.untyped_storage().size())
                elif storage.data_ptr() in done:
                    continue
                storage.copy_(new.untyped_storage())
                done.add(storage.data_ptr())
        self.graph = (outputs, inputs)

    def discard(self, consumer_output: torch.Tensor) -> None:
        """Free the outputs' storages now; rebuild them when ``consumer_output``'s gradient arrives (before the
        backward of anything that consumed them)."""
        if not consumer_output.requires_grad or self.ctx is None:
            return
        if any(out.untyped_storage().data_ptr() in self.input_storages for out in self.outputs):
            raise ValueError("a recomputed part returned a view of its input; nothing can be discarded")
        for out in self.outputs:
            out.untyped_storage().resize_(0)

        def hook(grad):
            if self.graph is None and self.ctx is not None:
                self.rebuild()
            return grad

        consumer_output.register_hook(hook)

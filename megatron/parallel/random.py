"""Named random-generator states, so dropout can differ across tensor-parallel ranks where it must.

Two streams, as in Megatron:

* the default generator, seeded with ``seed`` on every rank of a TP group: dropout on replicated
  activations ([s, b, h] after a row-parallel layer) draws the same mask on all TP ranks;
* a tracked state named ``"model-parallel-rng"``, seeded with ``seed + 2718 + tp_rank``: dropout on
  sharded activations (attention probabilities of this rank's heads) runs inside
  ``tracker.fork()`` and draws a different mask on each TP rank.

The tracker swaps the *default generator of one device* (the CPU's, or one CUDA device's) in and
out; it never touches the other devices. ``get_states`` / ``set_states`` let an activation
recompute (or a checkpoint) restore the tracked streams. Layers never reach a global tracker: the
module-level default below is a convenience for the training loop only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch
import torch.utils.checkpoint

__all__ = ["RNGStatesTracker", "MODEL_PARALLEL_RNG", "MODEL_PARALLEL_SEED_OFFSET",
           "model_parallel_rng_seed", "tracked_checkpoint_func", "sequence_parallel_dropout"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset: any positive constant keeps the streams apart


class RNGStatesTracker:
    """A dictionary of named generator states for one device, with ``fork(name)`` to use one.

    Same interface as Megatron's / DeepSpeed's ``CudaRNGStatesTracker`` (add, fork, get_states,
    set_states, reset), but works on the CPU as well.

    Args:
        device: the device whose default generator is tracked: "cpu", "cuda" or "cuda:N".
            Default: "cuda" if CUDA is available, else "cpu". Dropout draws from the generator of
            the device its tensor lives on, so choose the device of the activations.
    """

    def __init__(self, device: Optional[Union[str, torch.device]] = None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"RNGStatesTracker tracks 'cpu' or 'cuda' generators, got {self.device}")
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    # ---- the tracked device's default generator -------------------------------------------------
    def _generator(self) -> torch.Generator:
        if self.device.type == "cpu":
            return torch.default_generator
        torch.cuda.init()  # default_generators is empty until CUDA is initialized
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]

    def _get_state(self) -> torch.Tensor:
        return self._generator().get_state()

    def _set_state(self, state: torch.Tensor) -> None:
        self._generator().set_state(state)

    # ---- public interface -----------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every tracked state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """The tracked states by name. The dict is a copy; the states are never modified in place."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the tracked states (e.g. from :meth:`get_states` or a checkpoint)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` started from ``seed``; the current generator state is kept."""
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked; call reset() first")
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already used by another tracked RNG state; two "
                             f"streams from one seed would draw identical numbers")
        original = self._get_state()
        generator = self._generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()
        self.seeds_.add(seed)
        self._set_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the tracked state ``name`` inside the block; restore the default state after.

        The tracked state advances by what the block drew, so the next fork continues the stream.
        """
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not tracked (tracked: {sorted(self.states_)}); "
                             f"call add({name!r}, seed) or model_parallel_rng_seed() first")
        original = self._get_state()
        self._set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = self._get_state()
            self._set_state(original)


def model_parallel_rng_seed(seed: int, tp_rank: int, tracker: RNGStatesTracker) -> RNGStatesTracker:
    """Seed the default generators with ``seed`` and track ``seed + 2718 + tp_rank`` as
    "model-parallel-rng".

    Call it with the same ``seed`` on every rank of a TP group (add the pipeline / data-parallel
    rank to ``seed`` beforehand where those should differ). ``torch.manual_seed`` seeds the CPU and
    every CUDA device. ``tracker`` (the run's own: no process-wide one exists) is reset first.
    """
    if tp_rank < 0:
        raise ValueError(f"tp_rank must be >= 0, got {tp_rank}")
    torch.manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker


def tracked_checkpoint_func(tracker: Optional[RNGStatesTracker]):
    """An activation-checkpoint function that replays dropout exactly on recomputation.

    torch's non-reentrant checkpoint restores the default generators before recomputing; the
    tensor-parallel RNG tracker keeps its own states, so those are saved at the first forward
    and swapped back in for the recomputation (then restored), making the recomputed dropout
    masks equal to the original ones.
    """

    def checkpoint(function, *args):
        saved = tracker.get_states() if tracker is not None else None
        calls = {"n": 0}

        def run(*inner):
            calls["n"] += 1
            if calls["n"] == 1 or tracker is None:
                return function(*inner)
            after = tracker.get_states()
            tracker.set_states(saved)
            try:
                return function(*inner)
            finally:
                tracker.set_states(after)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)

    return checkpoint


def sequence_parallel_dropout(x: torch.Tensor, p: float, training: bool, rng_tracker: "RNGStatesTracker"
                              ) -> torch.Tensor:
    """Dropout of a sequence shard [s/tp, b, h]: drawn from the tracker's model-parallel stream, so each
    TP rank draws its own mask for its own tokens (the default stream is the same on every TP rank)."""
    if not training or p == 0.0:
        return x
    with rng_tracker.fork():
        return torch.nn.functional.dropout(x, p=p, training=True)

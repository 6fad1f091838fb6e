"""Peak activation memory per pipeline stage under 1F1B, ZB-H1 and interleaved 1F1B, measured on the engine
against the planner.

One 2-process launch trains a tiny BLOOM-style model (4 layers, hidden 64, seq 32, fp32, no dropout) at PP=2 with
4 micro-batches per step, first under 1F1B, then under ZB-H1 (--enable-zbh1-pipeline), then interleaved with v=2
virtual stages (one layer per chunk). On each stage the test
follows, through every training step, the bytes of every distinct storage that autograd keeps for backward inside
the transformer layers (saved-tensor hooks; parameters left out) plus what the deferred weight-gradient passes
hold (``WeightGradStore``: each linear's input and output gradient, the vocab-parallel head's too), and keeps the
peak. The planner's figure for the same stage (``megatron.planner.memory.activation_terms``' "saved": the
micro-batches in flight times the layers' activations, plus the W passes waiting times their inputs and output
gradients, at the schedule's peak; interleaved: the chunk micro-batches in flight at the first steady forward, over
v) must be within 5% of it (measured: within 0.8%; interleaved within 1.1%). Recomputation is not measured
here: torch's non-reentrant checkpoint keeps the layer inputs outside the saved-tensor hooks.
"""

import pytest

from megatron.testing import run_distributed, tiny_argv

ZBH1 = ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics")
VIRTUAL = ("--num-virtual-stages-per-pipeline-rank", "2")
SCHEDULES = {"1f1b": (), "zbh1": ZBH1, "interleaved": VIRTUAL}


class LiveBytes:
    """Bytes of distinct storages held by autograd's saved tensors and the deferred W passes, and their peak."""

    def __init__(self):
        self.refs, self.live, self.peak = {}, 0, 0
        self.excluded: set = set()     # parameter storages
        self.active = False

    def add(self, tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if not self.active or key in self.excluded or storage.nbytes() == 0:
            return None
        entry = self.refs.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        return key

    def release(self, key) -> None:
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[key]


class _Held:
    def __init__(self, tracker, tensor, key):
        self.tracker, self.tensor, self.key = tracker, tensor, key

    def __del__(self):
        if self.key is not None:
            self.tracker.release(self.key)


def _measure(rank, world_size, runs):
    import torch
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from megatron.arguments import run_config_from_argv
    from megatron.parallel.weight_grad_store import WeightGradStore
    from megatron.training.pretrain import pretrain

    tracker = LiveBytes()
    in_layer = [0]

    def pack(tensor):
        return _Held(tracker, tensor, tracker.add(tensor) if in_layer[0] else None)

    closed_keys = []
    close, run_oldest, train_batch = (WeightGradStore.close_micro_batch, WeightGradStore.run_oldest,
                                      PipelineEngine.train_batch)

    def close_micro_batch(self):
        close(self)
        keys = [tracker.add(t) for product in self._closed[-1] for t in product.args[1:]]
        closed_keys.append([k for k in keys if k is not None])

    def run(self):
        run_oldest(self)
        for key in closed_keys.pop(0):
            tracker.release(key)

    peaks = []

    def step(self, *args, **kwargs):
        if not tracker.excluded:
            tracker.excluded = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
            for module in self.module.modules():
                if type(module).__name__ == "TransformerLayer":
                    module.register_forward_pre_hook(lambda *_: in_layer.__setitem__(0, 1))
                    module.register_forward_hook(lambda *_: in_layer.__setitem__(0, 0))
        tracker.peak, tracker.active = tracker.live, True
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
                return train_batch(self, *args, **kwargs)
        finally:
            tracker.active = False
            peaks.append(tracker.peak)

    out = []
    WeightGradStore.close_micro_batch, WeightGradStore.run_oldest, PipelineEngine.train_batch = (
        close_micro_batch, run, step)
    try:
        for argv in runs:
            tracker.excluded = set()
            peaks.clear()
            pretrain(run_config_from_argv(argv, world_size=world_size))
            out.append({"peaks": list(peaks), "live_after": tracker.live})
    finally:
        WeightGradStore.close_micro_batch, WeightGradStore.run_oldest, PipelineEngine.train_batch = (
            close, run_oldest, train_batch)
    return out


ARGV = dict(train_iters=2, lr_warmup_iters=1, num_layers=4, pipeline_model_parallel_size=2)


@pytest.fixture(scope="module")
def measured(tiny_corpus):
    base = tiny_argv(tiny_corpus, **ARGV)
    runs = [base + list(flags) for flags in SCHEDULES.values()]
    return runs, run_distributed(_measure, world_size=2, args=(runs,), timeout=600)


@pytest.mark.multiprocess
def test_peak_activation_bytes_per_stage_match_the_planner(measured):
    from megatron.arguments import run_config_from_argv
    from megatron.dry_run.estimate import model_shape, planner_layout
    from megatron.planner.memory import activation_terms

    runs, per_rank = measured
    for run, (schedule, argv) in enumerate(zip(SCHEDULES, runs)):
        rc = run_config_from_argv(argv, world_size=2)
        layout = planner_layout(rc, [2, 2])  # the dry run's reading of the flags: its schedule too
        assert layout.schedule == schedule and layout.precision == "fp32"
        terms = activation_terms(model_shape(rc), layout, rc.data.seq_length, rc.batch.global_batch_size)
        for stage, results in enumerate(per_rank):
            peaks, predicted = results[run]["peaks"], terms[stage]["saved"]
            assert results[run]["live_after"] == 0, f"{layout.schedule} stage {stage}: bytes left after the steps"
            assert len(set(peaks)) == 1, f"{layout.schedule} stage {stage}: steps peak differently {peaks}"
            assert abs(peaks[0] / predicted - 1) < 0.05, \
                f"{layout.schedule} stage {stage}: measured {peaks[0]} B, planner {predicted:.0f} B"
    # what the schedule changes: ZB-H1's last stage holds p W passes (the head's logits gradient in each) beside
    # 1F1B's one micro-batch; its first stage the same as 1F1B's (p micro-batches in flight, then 1 W).
    # Interleaved (p = 2, v = 2, m = 4): rank 0 holds 5 chunk micro-batches of one layer (1F1B: 2 of two layers),
    # rank 1 holds 3 (1F1B: 1 of two layers); not exactly 5/4 and 3/2: a storage the two layers of a 1F1B stage
    # share for one micro-batch is counted once there, once per chunk here (measured: 1.246 and 1.485).
    (first_1f1b, first_zbh1, first_vpp), (last_1f1b, last_zbh1, last_vpp) = (
        [r["peaks"][0] for r in rank] for rank in per_rank)
    assert first_zbh1 == first_1f1b and last_zbh1 > 2 * last_1f1b
    assert first_vpp / first_1f1b == pytest.approx(5 / 4, rel=0.02), (first_vpp, first_1f1b)
    assert last_vpp / last_1f1b == pytest.approx(3 / 2, rel=0.02), (last_vpp, last_1f1b)

"""--recompute-granularity selective: only the attention core is recomputed. Loss and every gradient equal the
run without recomputation exactly (fp32, with attention dropout replayed from the TP-rank stream), the layer
keeps fewer bytes for backward, and a short training run gives the same losses bit for bit. Megatron-LM's
recompute flags map onto ours or are refused."""

import pytest
import torch

from megatron.model import GPTModel
from megatron.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from megatron.parallel.state import ParallelState
from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv
from tests.helpers.model import tiny_config
from tests.helpers.training import assert_same_run, train

SEQ = 64


def _loss_grads_saved_bytes(recompute: bool):
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 99)
    torch.manual_seed(0)
    config = tiny_config(position_embedding_type="alibi", seq_length=SEQ, attention_dropout=0.2,
                         recompute_core_attention=recompute)
    model = GPTModel(config, ParallelState.single(), rng_tracker=tracker).train()
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(5))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids, loss_mask=torch.ones(2, SEQ))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


def test_selective_recompute_gives_identical_loss_and_grads_and_keeps_less():
    loss, grads, saved = _loss_grads_saved_bytes(False)
    loss_r, grads_r, saved_r = _loss_grads_saved_bytes(True)
    # Exact: the checkpoint recomputes the same core attention on the same saved query, key and value with the
    # same kernels (and the replayed dropout mask) and backpropagates through it in the same order.
    assert loss_r == loss
    assert all(torch.equal(grads_r[n], grads[n]) for n in grads), [n for n in grads if not torch.equal(grads_r[n], grads[n])]
    assert saved_r < saved, (saved_r, saved)


@pytest.mark.multiprocess
def test_a_training_run_with_selective_recompute_has_the_same_losses(tiny_corpus):
    flags = dict(train_iters=3, lr_warmup_iters=1, global_batch_size=4)
    modules = ("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm", "mlp")
    runs = [tiny_argv(tiny_corpus, **flags), tiny_argv(tiny_corpus, recompute_granularity="selective", **flags),
            tiny_argv(tiny_corpus, *modules, **flags)]
    (plain, selective, recomputed), = run_distributed(train, world_size=1, args=(runs,), timeout=300)
    # Exact, as above: every step computes the same numbers in the same order, recomputed or kept.
    assert [h[1] for h in selective["history"]] == [h[1] for h in plain["history"]]
    # --recompute-modules core_attn layernorm mlp: the same products, the norms' outputs rebuilt in backward
    # (their input gradients summed before the residual's joins: within tolerance, tests/model/test_recompute_modules.py)
    assert_same_run(plain, recomputed, "--recompute-modules core_attn layernorm mlp")


def test_megatron_lm_recompute_flags_map_or_are_refused(tiny_corpus):
    from megatron.arguments import run_config_from_argv

    def config(*extra):
        return run_config_from_argv(tiny_argv(tiny_corpus, *extra), world_size=1)

    full = config("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2")
    assert full.training.checkpoint_activations and full.training.checkpoint_num_layers == 2
    assert not full.model.recompute_core_attention
    selective = config("--recompute-granularity", "selective")
    assert selective.model.recompute_core_attention and not selective.training.checkpoint_activations
    with pytest.raises(ValueError, match="not available on DeepSpeed's pipeline engine"):
        config("--recompute-granularity", "full", "--recompute-method", "block")
    both = config("--recompute-granularity", "selective", "--checkpoint-activations")  # full wins, as it nests
    assert both.training.checkpoint_activations and not both.model.recompute_core_attention
    assert [w for w in both.startup_warnings if "already recomputes the attention core" in w]

"""BatchKVCache: rows of different lengths decoded together equal each row decoded alone, for every position type."""

import pytest
import torch

from megatron.model import BatchKVCache, GPTModel
from megatron.model.positional import alibi_bias
from megatron.testing.tolerance import model_tolerance
from tests.helpers.checkpoint import POSITIONS, random_state_dict, tiny_model_config


@pytest.mark.parametrize("kind", sorted(POSITIONS))
def test_rows_of_different_lengths_decode_as_they_would_alone(kind):
    config = tiny_model_config(**POSITIONS[kind])
    model = GPTModel(config).eval()
    model.load_state_dict(random_state_dict(config))
    generator = torch.Generator().manual_seed(0)
    prompts = [[5], [17, 230, 41, 8], list(range(60, 80))]
    continuations = [torch.randint(0, 400, (6,), generator=generator).tolist() for _ in prompts]
    batch = [BatchKVCache() for _ in model.layers]
    with torch.no_grad():
        for prompt in prompts[:2]:  # each prompt fills a cache alone, which becomes a row
            alone = model.new_kv_caches()
            model(torch.tensor([prompt]), kv_caches=alone)
            for cache, filled in zip(batch, alone):
                cache.add_rows(filled.key, filled.value, [len(prompt)])
        padded = model.new_kv_caches()  # the long prompt beside a short one, right-padded to 20: rows 2 and 3
        model(torch.tensor([prompts[2], [9, 9, 9] + [0] * 17]), kv_caches=padded)
        for cache, filled in zip(batch, padded):
            cache.add_rows(filled.key, filled.value, [20, 3])
            assert cache.key[3, :, 3:].abs().max() == 0  # the padding's keys are not kept
            cache.keep_rows([0, 1, 2])  # the short one leaves at once
        assert batch[0].row_lengths.tolist() == [1, 4, 20]
        steps = [model(torch.tensor([[c[i]] for c in continuations]), kv_caches=batch)[-1] for i in range(3)]
        for cache in batch:
            cache.keep_rows([2, 0])  # the 4-token row leaves; the others keep decoding
        steps += [model(torch.tensor([[continuations[r][i]] for r in (2, 0)]), kv_caches=batch)[-1]
                  for i in range(3, 6)]
        for row, (prompt, continuation) in enumerate(zip(prompts, continuations)):
            full = model(torch.tensor([prompt + continuation]))[len(prompt):, 0]  # [6, vp]: no cache at all
            for i in range(6 if row != 1 else 3):
                batched = steps[i][row if i < 3 else (2, 0).index(row)]
                # the [b, h] matrix products may round differently from [1, h]: fp32 rounding, not positions
                assert (batched - full[i]).abs().max().item() <= model_tolerance(model.config, torch.float32,
                                                                                 full[i]), (kind, row, i)
    assert batch[0].row_lengths.tolist() == [26, 7]


def _rows(lengths, seed):
    """Keys and values [s, k, ng=2, hn=4] of k right-padded prompts, every entry nonzero."""
    generator = torch.Generator().manual_seed(seed)
    s = max(lengths)
    return tuple(torch.rand(s, len(lengths), 2, 4, generator=generator) + 1 for _ in range(2))


def test_rows_join_and_leave_in_place_and_keep_their_own_keys():
    cache = BatchKVCache()
    key, value = _rows([5, 2, 7, 3], seed=0)
    cache.add_rows(key, value, [5, 2, 7, 3])
    storage = cache.key.data_ptr()
    expected = {i: (key[:n, i], value[:n, i]) for i, n in enumerate([5, 2, 7, 3])}  # [n, ng, hn] per sequence
    cache.keep_rows([0, 2, 3])  # row 1 leaves: rows 2 and 3 move up a slot
    order = [0, 2, 3]
    late_key, late_value = _rows([2], seed=1)
    cache.add_rows(late_key, late_value, [2])  # into slot 3, which still holds the 3 positions of sequence 3
    expected[4] = (late_key[:, 0], late_value[:, 0])
    order.append(4)
    cache.keep_rows([1, 3, 2])  # sequences 2, 4, 3, reordered
    order = [order[r] for r in (1, 3, 2)]
    assert cache.key.data_ptr() == storage  # nothing was reallocated: the room was there
    assert cache.lengths == (7, 2, 3) and cache.row_lengths.tolist() == [7, 2, 3]
    for row, sequence in enumerate(order):
        want_key, want_value = expected[sequence]
        n = want_key.shape[0]
        assert torch.equal(cache.key[row, :, :n], want_key.transpose(0, 1)), (row, sequence)
        assert torch.equal(cache.value[row, :, :n], want_value.transpose(0, 1)), (row, sequence)
        assert cache.key[row, :, n:].abs().max() == 0 and cache.value[row, :, n:].abs().max() == 0  # zeros past it
    step_key, step_value = _rows([1, 1, 1], seed=2)
    keys, values = cache.append(step_key, step_value)  # one position per row, at each row's own length
    assert keys.shape == (8, 3, 2, 4) and cache.lengths == (8, 3, 4)
    for row, n in enumerate((7, 2, 3)):
        assert torch.equal(keys[n, row], step_key[0, row]) and torch.equal(values[n, row], step_value[0, row])
    with pytest.raises(ValueError, match="distinct rows"):
        cache.keep_rows([0, 0])


def test_rows_grow_past_their_room_and_keep_their_keys():
    cache = BatchKVCache()
    key, value = _rows([3], seed=3)
    cache.add_rows(key, value, [3])
    for seed in range(4, 7):  # one row of room, then 2, 4: the rows double
        more_key, more_value = _rows([2], seed=seed)
        cache.add_rows(more_key, more_value, [2])
    long_key, long_value = _rows([40], seed=7)  # longer than the 16 positions allocated: they double twice
    cache.add_rows(long_key, long_value, [40])
    assert cache.key.shape == (8, 2, 64, 4) and cache.lengths == (3, 2, 2, 2, 40)
    assert torch.equal(cache.key[0, :, :3], key[:, 0].transpose(0, 1)) and cache.key[0, :, 3:].abs().max() == 0
    assert torch.equal(cache.value[4, :, :40], long_value[:, 0].transpose(0, 1))

    cache.keep_rows([4, 0, 1])  # the room stays while more than a quarter of it is in use ...
    assert cache.key.shape == (8, 2, 64, 4) and cache.lengths == (40, 3, 2)
    cache.keep_rows([1, 2])  # ... then halves: rows 8 -> 4 (2 in use), positions 64 -> 16 (the 40 has left)
    assert cache.key.shape == (4, 2, 16, 4) and cache.lengths == (3, 2)
    assert torch.equal(cache.key[0, :, :3], key[:, 0].transpose(0, 1)) and cache.key[0, :, 3:].abs().max() == 0
    cache.keep_rows([0])
    assert cache.key.shape == (2, 2, 16, 4) and cache.lengths == (3,)  # rows 4 -> 2; 16 positions at least
    assert torch.equal(cache.key[0, :, :3], key[:, 0].transpose(0, 1)) and cache.key[0, :, 3:].abs().max() == 0
    step_key, step_value = _rows([1], seed=9)
    keys, _ = cache.append(step_key, step_value)  # decoding continues on the smaller storage
    assert keys.shape == (4, 1, 2, 4) and torch.equal(keys[3, 0], step_key[0, 0])
    cache.keep_rows([])  # ... and goes with the last one
    assert cache.key is None and cache.value is None and cache.lengths == () and cache.length == 0
    short_key, short_value = _rows([3, 5], seed=8)
    cache.add_rows(short_key, short_value, [3, 5])  # a new batch allocates for itself
    assert cache.key.shape == (2, 2, 16, 4) and cache.lengths == (3, 5) and cache.row_lengths.tolist() == [3, 5]
    assert torch.equal(cache.key[1, :, :5], short_key[:, 1].transpose(0, 1))


def test_the_layers_of_one_decode_step_share_one_alibi_bias(monkeypatch):
    import megatron.model.attention as attention

    config = tiny_model_config(num_layers=3)
    model = GPTModel(config).eval()
    attention.rows_attention_mask.__wrapped__.cache_clear()  # the masks of earlier tests
    built = []
    monkeypatch.setattr(attention, "alibi_bias", lambda *args: built.append(args) or alibi_bias(*args))
    batch = [BatchKVCache() for _ in model.layers]
    with torch.no_grad():
        alone = model.new_kv_caches()
        model(torch.tensor([[5, 6, 7], [8, 9, 0]]), kv_caches=alone)
        for cache, filled in zip(batch, alone):
            cache.add_rows(filled.key, filled.value, [3, 2])
        built.clear()
        for token in (11, 12):
            model(torch.tensor([[token], [token]]), kv_caches=batch)
    assert len(built) == 2  # one bias per step (rows at 3 and 2, then 4 and 3), not one per layer

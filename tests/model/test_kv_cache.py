"""BatchKVCache: rows of different lengths decoded together equal each row decoded alone, for every position type."""

import pytest
import torch

from megatron.model import BatchKVCache, GPTModel

from tests.checkpoint.helpers import random_state_dict, tiny_model_config
from tests.inference.test_generation import POSITIONS


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
                assert (batched - full[i]).abs().max().item() < 1e-4, (kind, row, i)
    assert batch[0].row_lengths.tolist() == [26, 7]

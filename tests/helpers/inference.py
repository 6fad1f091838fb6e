"""Prompts and fixed batches for the generation tests, and a training run that also evaluates one batch.

The tiny corpus's tokenizer has ``VOCAB`` tokens; its models pad the vocabulary to ``PADDED``.
"""

import torch

from tests.helpers.training import record_run

VOCAB, PADDED = 400, 512
# Text prompts: greedy continuations of ours and of transformers' models are compared on them.
PROMPTS = ["The river", "Model data train the", "North city music", "A", "Pipeline stage tensor parallel gradient"]
# Token-id prompts of 1 to 30 tokens, and how many tokens each asks for: batched decoding's cases.
_LENGTHS = [1, 7, 3, 19, 2, 11, 5, 24, 1, 9, 14, 4, 30, 6, 2, 17, 8, 12]
TOKEN_PROMPTS = [[(37 * i + 11 * j + 5) % VOCAB for j in range(n)] for i, n in enumerate(_LENGTHS)]
MAX_NEW_TOKENS = [12, 5, 20, 9, 16, 3, 14, 7, 18, 10, 1, 13, 6, 15, 11, 8, 17, 4]


def fixed_tokens() -> torch.Tensor:
    """A fixed batch of token ids, [b, s + 1] = [2, 33]."""
    return torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(11))


def train_and_evaluate(rank, world_size, argv):
    """On each rank (a ``run_distributed`` target, pipeline engine): ``pretrain(argv)``, then the engine's
    logits on ``fixed_tokens()``. Returns ``tests.helpers.training.record_run``'s record; on the last stage
    also ``logits`` ([s, b, vp] of this TP rank, numpy), ``tp_rank`` and ``dp_rank``."""
    from megatron.arguments import run_config_from_argv
    from megatron.training.batches import gpt_micro_batch
    from megatron.training.pretrain import pretrain

    rc = run_config_from_argv(argv, world_size=world_size)
    result = pretrain(rc)
    out = record_run(rc, result)
    engine = result.engine
    _, logits = engine.eval_batch(iter([gpt_micro_batch(fixed_tokens())]), return_logits=True, num_micro_batches=1)
    if engine.is_last_stage():
        # numpy: a torch tensor would travel as shared memory that dies with this process
        out.update(logits=logits.detach().numpy().copy(), tp_rank=engine.grid.get_slice_parallel_rank(),
                   dp_rank=engine.grid.get_data_parallel_rank())
    return out

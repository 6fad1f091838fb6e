"""The run's datasets and data iterators, from its ``DataConfig`` (Megatron's sample counts).

    train samples = --train-samples, or --train-iters x global batch
    valid samples = eval_iters x global batch x (train_iters // eval_interval + 1)   (per group)
    test samples  = eval_iters x global batch

Every rank builds the datasets (each rank of a stage reads the samples of its data-parallel
slice itself); global rank 0 builds missing index files while the others wait at a barrier.
"""

from __future__ import annotations

import atexit
import dataclasses
import weakref

from megatron.config import RunConfig
from megatron.data.gpt_dataset import build_train_valid_test_datasets, build_weighted_split_datasets
from megatron.data.samplers import build_pretraining_data_loader
from megatron.training.batches import MicroBatchIterator
from megatron.training.exit import data_loader_worker_init


@dataclasses.dataclass
class RunDatasets:
    train: object
    valid: dict[str, object]   # name ('' for the plain --data-path split) -> dataset
    test: dict[str, object]


def train_iters_estimate(rc: RunConfig) -> int:
    t = rc.training
    if t.train_iters is not None:
        return t.train_iters
    return t.train_samples // rc.batch.global_batch_size


def num_samples(rc: RunConfig) -> tuple[int, int, int]:
    t, gbs = rc.training, rc.batch.global_batch_size
    train = t.train_samples if t.train_samples is not None else t.train_iters * gbs
    evals = train_iters_estimate(rc) // t.eval_interval + 1 if t.eval_interval else 1
    return train, t.eval_iters * gbs * evals, t.eval_iters * gbs


def build_datasets(rc: RunConfig) -> RunDatasets:
    """The train, validation and test datasets; their index files go to --data-cache-path, else beside the data."""
    d = rc.data
    n_train, n_valid, n_test = num_samples(rc)
    common = dict(seq_length=d.seq_length, seed=d.seed, cache_dir=d.data_cache_path)
    if d.uses_weighted_splits:
        return RunDatasets(*build_weighted_split_datasets(
            d.train_weighted_split_groups, d.valid_weighted_split_groups, d.test_weighted_split_groups,
            (n_train, n_valid, n_test), **common))
    train, valid, test = build_train_valid_test_datasets(d.data_path, d.split or "969,30,1",
                                                         (n_train, n_valid, n_test), **common)
    return RunDatasets(train, {"": valid} if valid is not None else {}, {"": test} if test is not None else {})


# Every iterator made here, closed by close_data_iterators: the DataLoader workers ignore SIGTERM, and
# Python's multiprocessing ends a process's daemonic children at exit with SIGTERM, then joins them: a
# worker still running then would hold the rank's exit forever.
_open_iterators: "weakref.WeakSet[MicroBatchIterator]" = weakref.WeakSet()


def close_data_iterators() -> None:
    """Stop the worker processes of every data iterator still open (pretrain's end, and at exit)."""
    for iterator in list(_open_iterators):
        iterator.close()


atexit.register(close_data_iterators)  # runs before multiprocessing's own exit handler (registered earlier)


def micro_batch_iterator(dataset, rc: RunConfig, *, consumed_samples: int, dp_rank: int, dp_size: int,
                         num_workers: int, sp_rank: int = 0, sp_size: int = 1, cp_rank: int = 0,
                         cp_size: int = 1) -> MicroBatchIterator:
    """This data-parallel rank's pipeline micro-batches of ``dataset``, from ``consumed_samples`` on (with
    Ulysses, sp_size > 1, this sequence-parallel rank's slice of each; with cp_size > 1, this context-parallel
    rank's load-balanced tokens)."""
    loader = build_pretraining_data_loader(dataset, consumed_samples, rc.batch.micro_batch_size, dp_rank, dp_size,
                                           num_workers=num_workers, worker_init_fn=data_loader_worker_init)
    d = rc.data
    iterator = MicroBatchIterator(loader, sp_rank, sp_size, eod=d.eod_token_id, eod_mask_loss=d.eod_mask_loss,
                                  reset_position_ids=d.reset_position_ids, cp_rank=cp_rank, cp_size=cp_size,
                                  reset_attention_mask=d.reset_attention_mask)
    _open_iterators.add(iterator)
    return iterator

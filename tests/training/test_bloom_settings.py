"""BLOOM's own settings train unchanged: ``--bf16 --zero-stage 0`` (its tr11 script) runs DeepSpeed's
BF16_Optimizer, and ``--data-cache-path`` puts the sample indexes in their own folder, leaving the data
folder untouched; that folder is made read-only for root too (``chattr +i``) where the filesystem
allows it. One 2-rank launch (TP=1, PP=1, DP=2), checked by both tests."""

import math
import pathlib
import shutil

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.paths import make_read_only, make_writable
from tests.helpers.training import train

ITERS = 3
INDEX_PARTS = ("doc_idx.npy", "sample_idx.npy", "shuffle_idx.npy", "description.json")


def _listing(folder: pathlib.Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def bloom_run(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("bloom_settings")
    data = root / "data"  # a copy of the corpus and its tokenizer, without the index files other tests left
    data.mkdir()
    corpus = {key: shutil.copy(tiny_corpus[key], data) for key in ("vocab_file", "merge_file")}
    for ext in (".bin", ".idx"):
        shutil.copy(tiny_corpus["data_prefix"] + ext, data)
    corpus["data_prefix"] = str(data / pathlib.Path(tiny_corpus["data_prefix"]).name)
    cache = root / "index-cache" / "gpt"  # does not exist yet: the run creates it
    argv = tiny_argv(corpus, bf16=True, zero_stage=0, data_cache_path=str(cache), train_iters=ITERS)
    before = _listing(data)
    read_only = make_read_only(data)
    try:
        results = [run for (run,) in run_distributed(train, world_size=2, args=([argv],), timeout=600)]
    finally:
        make_writable(data)
    return {"results": results, "read_only": read_only, "data_before": before, "data_after": _listing(data),
            "cache": cache, "prefix": pathlib.Path(corpus["data_prefix"]).name}


@pytest.mark.multiprocess
def test_bf16_zero_stage_0_trains_with_bf16_optimizer_sharded_over_dp(bloom_run):
    for rank, run in enumerate(bloom_run["results"]):
        assert (run["optimizer"], run["asked_stage"], run["engine_stage"]) == ("BF16_Optimizer", 0, 1), f"rank {rank}"
        notes = [w for w in run["warnings"] if "--zero-stage" in w]
        assert len(notes) == 1 and "runs DeepSpeed's BF16_Optimizer (ZeRO stage 1)" in notes[0], f"rank {rank}"
        assert len(run["losses"]) == ITERS and all(math.isfinite(x) for x in run["losses"]), f"rank {rank}"
        # fp32 master weights partitioned over DP=2: each rank holds half of them (DeepSpeed pads a little)
        half = run["held_numel"] / 2
        assert half <= run["master_numel"] <= half + 64, f"rank {rank}: {run['master_numel']} of {run['held_numel']}"


@pytest.mark.multiprocess
def test_index_files_go_to_the_cache_path_and_nothing_new_to_the_data_folder(bloom_run):
    assert bloom_run["data_after"] == bloom_run["data_before"], "the run wrote into the data folder"
    cached = sorted(p.name for p in bloom_run["cache"].iterdir())
    train = [name for name in cached if name.startswith(f"{bloom_run['prefix']}_train_indexmap_{ITERS * 8}ns_32sl_")]
    assert len(train) == len(INDEX_PARTS) and all(any(n.endswith("_" + part) for n in train) for part in INDEX_PARTS), \
        cached
    assert all(name.endswith(INDEX_PARTS) for name in cached), cached

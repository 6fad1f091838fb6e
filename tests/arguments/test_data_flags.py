"""The data flags: --data-path blends, BLOOM's weighted split paths (exclusive with --data-path),
the files they name, --skip-train-iteration-range merging, and evaluation without validation data."""

import pytest

from megatron.arguments import merge_skip_ranges
from megatron.config import DatasetSplit
from tests.helpers.arguments import bloom_setup, parse, parse_bloom


def test_data_path_blend_and_skip_ranges(files):
    rc = parse(files, data_path=["0.3", files / "a", "0.7", files / "b"],
               skip_train_iteration_range=["101-200", "5-6", "150-300"])
    assert rc.data.data_path == ((0.3, str(files / "a")), (0.7, str(files / "b")))
    assert rc.training.skip_train_iteration_range == ((5, 6), (101, 300))
    assert merge_skip_ranges(["1-5", "2-6", "8-8"]) == ((1, 6), (8, 8))


def test_bad_skip_ranges_are_named():
    with pytest.raises(ValueError, match="'5' is not START-END"):
        merge_skip_ranges(["5"])
    with pytest.raises(ValueError, match="'9-3': END 3 is before START 9"):
        merge_skip_ranges(["9-3"])


def test_eval_can_be_disabled_without_validation_data(files):
    rc = parse(files, split="100,0,0", eval_iters=0)
    assert rc.training.eval_iters == 0 and rc.data.split == "100,0,0" and not rc.data.has_validation_data


def test_missing_data_files_are_named(files):
    with pytest.raises(ValueError, match=r"data files not found: .*nope\.bin"):
        parse(files, data_path=files / "nope")


def test_weighted_split_file_format_errors_name_the_file(tmp_path):
    argv, _ = bloom_setup(tmp_path)
    (tmp_path / "valid-splits.txt").write_text('"valid_en: 1 0.95:1.0"\n')
    with pytest.raises(ValueError, match=r"valid-splits.txt: '1 0.95:1.0' in group 'valid_en' is not"):
        parse_bloom(argv)
    (tmp_path / "valid-splits.txt").write_text("no quotes here\n")
    with pytest.raises(ValueError, match="expected one line of double-quoted groups"):
        parse_bloom(argv)


def test_data_modes_are_exclusive(files):
    group = f"g: 1 0:1 {files / 'a'}"
    with pytest.raises(ValueError, match="--data-path and --\\(train\\|valid\\|test\\)-weighted-split-paths"):
        parse(files, train_weighted_split_paths=[group])
    ok = parse(files, drop=["--data-path"], train_weighted_split_paths=[group],
               valid_weighted_split_paths=[f"v: 1 0:1 {files / 'b'}"])
    assert ok.data.train_weighted_split_groups[0].datasets == (DatasetSplit(1.0, 0.0, 1.0, str(files / "a")),)
    assert ok.data.data_path == () and ok.data.split is None and ok.data.has_validation_data


def test_data_cache_path_is_checked_creatable_and_writable_without_creating_it(files, read_only_folder):
    new = files / "cache" / "new"
    rc = parse(files, data_cache_path=new)
    assert rc.data.data_cache_path == str(new) and not (files / "cache").exists()  # checked, not created
    assert parse(files).data.data_cache_path is None  # default: the index files go beside the data
    (files / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"--data-cache-path .*a-file.*is not a directory"):
        parse(files, data_cache_path=files / "a-file" / "cache")
    locked = files / "locked"
    locked.mkdir()
    if not read_only_folder(locked):
        pytest.skip(f"cannot make {locked} read-only here (no chattr +i on this filesystem)")
    with pytest.raises(ValueError, match=r"--data-cache-path .*locked' is not writable by this user"):
        parse(files, data_cache_path=locked)
    with pytest.raises(ValueError, match=r"--data-cache-path .*sub' cannot be created: .*locked' is not writable"):
        parse(files, data_cache_path=locked / "sub")


@pytest.mark.parametrize("flag", ["save", "tensorboard_dir"])
def test_output_folders_are_checked_writable_before_anything_starts(files, read_only_folder, flag):
    extra = {"save_interval": 10} if flag == "save" else {}
    rc = parse(files, **{flag: files / "out"}, **extra)
    assert (rc.checkpoint.save if flag == "save" else rc.logging.tensorboard_dir) == str(files / "out")
    locked = files / "locked"
    locked.mkdir()
    if not read_only_folder(locked):
        pytest.skip(f"cannot make {locked} read-only here (no chattr +i on this filesystem)")
    option = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=rf"{option} .*locked' is not writable by this user"):
        parse(files, **{flag: locked}, **extra)


def test_training_data_without_documents_is_refused_before_anything_starts(files):
    from megatron.testing.tiny_corpus import write_stand_in_dataset

    empty = write_stand_in_dataset(files / "empty", num_documents=0)
    with pytest.raises(ValueError, match=r"--data-path .*empty: 0 documents, .* rebuild the dataset"):
        parse(files, data_path=empty)
    with pytest.raises(ValueError, match=r"100 documents, of which --split '0,50,50' leaves none for training"):
        parse(files, split="0,50,50")
    tiny_range = f"t: 1 0:0.001 {files / 'a'}"  # 0.1 of a document out of 100
    with pytest.raises(ValueError, match=r"group 't': range 0.0:0.001 of .*a \(100 documents\) holds no documents"):
        parse(files, drop=["--data-path"], train_weighted_split_paths=[tiny_range])

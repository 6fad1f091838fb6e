"""The one parser of the dataset flags (--split, --data-path, weighted split paths and their files)
and the blend arithmetic: results, and errors that name the flag, the group and the entry."""

import pytest

from megatron.config import DatasetGroup, DatasetSplit
from megatron.data.dataset_utils import (
    document_range,
    normalize_weights,
    parse_data_path,
    parse_group,
    parse_split,
    parse_weighted_split_paths,
    per_dataset_num_samples,
    read_groups_file,
)


def test_parse_split():
    assert parse_split("969,30,1", 1000) == [0, 969, 999, 1000]
    assert parse_split("98/2", 100) == [0, 98, 100, 100]
    assert parse_split("1", 7) == [0, 7, 7, 7]
    assert parse_split("1,1,1", 10)[-1] == 10
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad, 10)


def test_parse_data_path_and_sample_counts():
    assert parse_data_path(["/d/a_text_document"]) == ((1.0, "/d/a_text_document"),)
    assert parse_data_path(None) == () and parse_data_path([]) == ()  # the flag is optional
    pairs = parse_data_path("0.3 /d/A 0.7 /d/B".split())
    assert pairs == ((0.3, "/d/A"), (0.7, "/d/B"))
    weights = normalize_weights([w for w, _ in pairs])
    # exact: w / sum(w), with sums (1.0, 4.0) and quotients (0.3, 0.7, 0.75, 0.25) that round to these doubles
    assert weights == [0.3, 0.7] and normalize_weights([3, 1]) == [0.75, 0.25]
    assert per_dataset_num_samples(weights, [1000, 100, 0]) == [[302, 31, 0], [704, 71, 0]]
    for bad, message in [(["0.3", "/d/A", "0.7"], "odd"), (["x", "/d/A", "1", "/d/B"], r"'x' \(before '/d/A'\) is not"),
                         (["0", "/d/A", "1", "/d/B"], "> 0"), (["-1", "/d/A", "2", "/d/B"], "> 0"),
                         (["nan", "/d/A", "1", "/d/B"], "finite")]:
        with pytest.raises(ValueError, match=f"--data-path.*{message}"):
            parse_data_path(bad)
    with pytest.raises(ValueError, match="sum to > 0"):
        normalize_weights([0.0])


def test_parse_group():
    group = parse_group("TRAIN: 0.6 0:0.6 /path/A, 0.4 0:1 /path/with space/B", "--train-weighted-split-paths")
    assert group == DatasetGroup("TRAIN", (DatasetSplit(0.6, 0.0, 0.6, "/path/A"),
                                           DatasetSplit(0.4, 0.0, 1.0, "/path/with space/B")))
    assert document_range(group.datasets[0], 10) == (0, 6) and document_range(group.datasets[1], 7) == (0, 7)
    flag = "--valid-weighted-split-paths"
    for bad, message in [
        ("no colon here", r"'no colon here' is not of the form"),
        ("two words: 1 0:1 /a", "a name without spaces"),          # a forgotten name: '1 0' would be taken as it
        ("A:", "is not of the form"),
        ("A: 1 0:1", r"'1 0:1' in group 'A' is not 'WEIGHT START:END PREFIX'"),
        ("A: 1 0:1 /a, 1 0-1 /b", r"'1 0-1 /b' in group 'A' is not"),
        ("A: 1 0.5:0.2 /a", r"'1 0.5:0.2 /a' in group 'A': range 0.5:0.2 needs 0 <= START < END <= 1"),
        ("A: 1 0:1.5 /a", "START < END <= 1"),
        ("A: 1 x:1 /a", r"'1 x:1 /a' in group 'A': START and END must be numbers"),
        ("A: 0 0:1 /a", r"weight 0 \(of '/a' in group 'A'\) must be a finite number > 0"),
        ("A: w 0:1 /a", r"'w' \(of '/a' in group 'A'\) is not a weight"),
    ]:
        with pytest.raises(ValueError, match=f"^{flag}: .*{message}"):
            parse_group(bad, flag)


def test_parse_weighted_split_paths():
    groups = parse_weighted_split_paths(["EN: 1 0.9:1 /d/en", "MIX: 0.5 0.9:1 /d/en, 0.5 0.9:1 /d/fr"], "valid")
    assert [g.name for g in groups] == ["EN", "MIX"] and [d.prefix for d in groups[1].datasets] == ["/d/en", "/d/fr"]
    assert parse_weighted_split_paths(None, "test") == ()
    # Already-parsed groups (DataConfig's) pass through and are checked alike.
    assert parse_weighted_split_paths([groups[0], "FR: 1 0:1 /d/fr"], "valid")[0] is groups[0]
    for values, split, message in [
        (["A: 1 0:1 /a", "B: 1 0:1 /b"], "train", r"--train-weighted-split-paths takes one group, got 2 \(A, B\)"),
        (["A: 1 0:1 /a", "A: 1 0:1 /b"], "valid", r"--valid-weighted-split-paths: group names must be unique, "
                                                  r"repeated: \['A'\]"),
        (["A: 1 0.5:0.2 /a"], "test", r"--test-weighted-split-paths: '1 0.5:0.2 /a' in group 'A'"),
        (["A: 1 0:1 /a"], "eval", "not one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_weighted_split_paths(values, split)


def test_groups_file_is_one_line_of_quoted_groups(tmp_path):
    """Megatron-DeepSpeed's ParseDataPathsPath: one line, each group in double quotes, separated by
    spaces, as BigScience's load_ratios_meg_ds_format.py writes it."""
    path = tmp_path / "valid-splits.txt"
    path.write_text('"EN: 1 0.9:1 /d/en" "MIX: 0.5 0.9:1 /d/en, 0.5 0.9:1 /d/with space/fr"\n')
    assert read_groups_file(path, "--valid-weighted-split-paths-path") == \
        ["EN: 1 0.9:1 /d/en", "MIX: 0.5 0.9:1 /d/en, 0.5 0.9:1 /d/with space/fr"]
    groups = parse_weighted_split_paths(None, "valid", file=path)
    assert [g.name for g in groups] == ["EN", "MIX"]
    assert groups[1].datasets[1] == DatasetSplit(0.5, 0.9, 1.0, "/d/with space/fr")
    flag = f"--valid-weighted-split-paths-path '{path}'"
    for text, message in [
        ('"EN: 1 0.9:1 /d/en"\n"MIX: 1 0.9:1 /d/fr"\n', "expected one line of double-quoted groups .* got 2 line"),
        ("EN: 1 0.9:1 /d/en\n", "expected one line of double-quoted groups"),  # unquoted
        ("\n", "expected one line .* got 0 line"),
        ('"EN: 1 0.9:1 /d/en" "MIX: 1 0.9:1 /d/fr" "\n', "No closing quotation"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=f"^{flag}: {message}"):
            parse_weighted_split_paths(None, "valid", file=path)
    path.write_text('"EN: 1 0.9:1"\n')   # an entry error names the file and the group
    with pytest.raises(ValueError, match=r"-path .*valid-splits.txt: '1 0.9:1' in group 'EN' is not"):
        parse_weighted_split_paths(None, "valid", file=path)
    with pytest.raises(ValueError, match="cannot read it"):
        parse_weighted_split_paths(None, "valid", file=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="--valid-weighted-split-paths and --valid-weighted-split-paths-path both"):
        parse_weighted_split_paths(["EN: 1 0:1 /d/en"], "valid", file=path)

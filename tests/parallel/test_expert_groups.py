"""The expert-parallel groups are carved from the data-parallel ranks as Megatron-LM and DeepSpeed carve them:
EP groups of consecutive data ranks, expert-data-parallel groups of stride ep (over every sequence rank, CP's or
Ulysses'); every rank in exactly one of each."""

import pytest

from megatron.parallel.state import group_layout


def test_expert_groups_of_tp2_pp2_dp4_ep2():
    layout = group_layout(tp=2, pp=2, dp=4, ep=2)
    # data group of (pipe 0, model 0): ranks 0, 2, 4, 6 (TP innermost)
    assert [0, 2, 4, 6] in layout.data
    assert [0, 2] in layout.expert and [4, 6] in layout.expert
    assert [0, 4] in layout.expert_data and [2, 6] in layout.expert_data
    for groups in (layout.expert, layout.expert_data):
        assert sorted(r for g in groups for r in g) == list(range(16))
    for ep_group in layout.expert:  # an EP group lies inside one data group
        assert any(set(ep_group) <= set(data) for data in layout.data)


def test_ep_one_gives_one_rank_expert_groups_and_the_data_group_for_experts():
    layout = group_layout(tp=1, pp=1, dp=4)
    assert layout.expert == [[0], [1], [2], [3]] and layout.expert_data == [[0, 1, 2, 3]]


@pytest.mark.parametrize("dp,ep,sp,match", [
    (4, 3, 1, "--expert-model-parallel-size 3 does not divide the data-parallel size 4"),
])
def test_bad_expert_layouts_are_refused(dp, ep, sp, match):
    with pytest.raises(ValueError, match=match):
        group_layout(tp=1, pp=1, dp=dp, sp=sp, ep=ep)


@pytest.mark.parametrize("axis", ["cp", "sp"])
def test_the_expert_data_group_spans_the_sequence_ranks(axis):
    """With the sequence split (CP or Ulysses, rank = dp_rank * 2 + seq_rank at TP = 1): an EP group stays on one
    sequence rank (its tokens' slice), and the expert-data-parallel group holds every sequence rank of the same
    experts, whose gradients come from other tokens of the same samples."""
    layout = group_layout(tp=1, pp=1, dp=4, ep=2, **{axis: 2})
    assert layout.expert == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout.expert_data == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for groups in (layout.expert, layout.expert_data):
        assert sorted(r for g in groups for r in g) == list(range(8))

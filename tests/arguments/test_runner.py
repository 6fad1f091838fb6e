"""The argument pipeline (megatron.arguments.steps / .pipeline): one declared list of steps, run by a real
launch (stop at the first problem) and by the dry run (collect every problem, say what could not be checked)."""

import pytest

from megatron.arguments import run_config_from_argv
from megatron.arguments.check import check_argv
from megatron.arguments.flags import build_parser
from megatron.arguments.runner import FAILED, OK, run_steps
from megatron.arguments.steps import SETTINGS, STEPS, Run
from tests.helpers.arguments import tiny_config_argv


def test_every_step_is_named_once_and_needs_only_earlier_steps():
    names = [step.name for step in STEPS]
    assert len(set(names)) == len(names)
    for index, step in enumerate(STEPS):
        assert set(step.needs) <= set(names[:index]), step.name
        assert step.on in ("args", "run"), step.name


def test_a_run_fills_in_every_field_the_steps_declare(tokenizer_files):
    run = Run(build_parser().parse_args(tiny_config_argv(tokenizer_files)), lambda: (2, 0))
    outcome = run_steps(run)
    assert set(outcome.state.values()) == {OK} and outcome.problems == []
    for step in STEPS:  # the Run's own fields (config, tokenizer) or the Namespace's
        for field in step.produces:
            assert getattr(run, field) is not None if field in vars(run) else hasattr(run.args, field), field
    assert run.config.model.padded_vocab_size == 512 and run.tokenizer.vocab_size == 400


def test_the_stop_mode_raises_the_first_problem_the_collect_mode_lists(files):
    argv = tiny_config_argv(files, deepspeed_config=files / "missing.json", min_lr=1.0)
    with pytest.raises(ValueError) as info:
        run_config_from_argv(argv, world_size=3, with_vocab=False)
    run = Run(build_parser().parse_args(argv), lambda: (3, 0), collect=True, with_vocab=False)
    outcome = run_steps(run)
    assert outcome.problems[0] == str(info.value) and len(outcome.problems) == 1  # the JSON: the rest waits on it
    assert outcome.state["the DeepSpeed JSON"] == FAILED
    assert outcome.state[SETTINGS] == outcome.state["the startup warnings"] == "the DeepSpeed JSON"
    assert outcome.state["the data files"] == OK  # no need of the JSON: checked all the same


def test_independent_checks_all_run_and_waiting_ones_are_named_with_what_they_wait_on(files):
    (files / "b.idx").unlink()
    argv = tiny_config_argv(files, data_path=[0.5, files / "a", 0.5, files / "b"], min_lr=1.0, peak_tflops=0,
                            tensor_model_parallel_size=2)
    check = check_argv(argv + ["--dry-run", "--world-size", "3"])
    assert [p.split(" ")[0] for p in check.problems] == ["world", "data"]  # the settings wait on the layout
    assert check.not_checked[0].startswith("the run configuration, the settings' own rules")
    assert check.not_checked[0].endswith("need the parallel sizes against the world size (see the problems above)")
    assert "the training split's documents" in check.not_checked[1]  # waits on the data files
    check = check_argv(argv + ["--dry-run", "--world-size", "4"])
    assert [p.split(" ")[0] for p in check.problems] == ["data", "--min-lr", "--peak-tflops"]  # each part on its own
    assert check.run_config is None and any("the rules across settings" in line for line in check.not_checked)

"""W&B's flags (Megatron-LM's names), its folder, the refusals where the wandb package is missing, where W&B cannot
start, and where the last rank cannot open its writers (every rank stops). That a run logs to W&B what it logs to
tensorboard is tests/training/test_exits_and_tensorboard.py's (a real offline run)."""

import sys

import pytest
import torch.distributed as dist

from megatron.arguments import run_config_from_argv
from megatron.config.run import LoggingConfig
from megatron.testing import run_distributed, tiny_argv
from megatron.training.log_writers import check_wandb_installed, open_writers, wandb_enabled, wandb_save_dir
from megatron.training.pretrain import pretrain
from tests.helpers.training import pretrain_error


def test_megatron_lm_wandb_and_throughput_flags_reach_the_logging_config(tiny_corpus):
    argv = tiny_argv(tiny_corpus, wandb_project="llama", wandb_exp_name="run-1", wandb_save_dir="/runs/w",
                     wandb_entity="team", log_throughput=True)
    log = run_config_from_argv(argv, world_size=1).logging
    assert (log.wandb_project, log.wandb_exp_name, log.wandb_save_dir, log.wandb_entity, log.log_throughput) == (
        "llama", "run-1", "/runs/w", "team", True)
    assert wandb_enabled(log)
    # a launch script's unset ${WANDB_PROJECT}: an empty project is no W&B, as in Megatron-LM
    unset = run_config_from_argv(tiny_argv(tiny_corpus, "--wandb-project", "", wandb_exp_name="run-1"), world_size=1)
    assert not wandb_enabled(unset.logging) and not unset.logging.log_throughput


def test_wandb_folder_is_the_flag_else_the_save_folders_else_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert wandb_save_dir(LoggingConfig(wandb_project="p", wandb_save_dir="/w"), "/ckpt") == "/w"
    assert wandb_save_dir(LoggingConfig(wandb_project="p"), "/ckpt") == "/ckpt/wandb"
    assert wandb_save_dir(LoggingConfig(wandb_project="p"), None) == str(tmp_path)


def test_a_missing_wandb_package_is_refused_before_any_process_group(tiny_corpus, monkeypatch):
    rc = run_config_from_argv(tiny_argv(tiny_corpus, wandb_project="llama"), world_size=1)
    check_wandb_installed(rc.logging)  # installed here (requirements.txt)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails, as where it is not installed
    with pytest.raises(ValueError, match=r"--wandb-project 'llama' .* wandb package is not installed.*"
                                         r"pip install -r requirements\.txt"):
        pretrain(rc)
    assert not dist.is_initialized()
    check_wandb_installed(LoggingConfig())  # no project, no W&B, no need for the package


def _no_wandb_login(monkeypatch, home):
    """Online mode, and no login: no API key, no ~/.netrc, no saved settings."""
    for name in ("WANDB_API_KEY", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))


def test_online_without_a_login_stops_at_start_naming_offline_mode(tmp_path, monkeypatch):
    import wandb

    _no_wandb_login(monkeypatch, tmp_path)
    logging = LoggingConfig(wandb_project="llama", wandb_save_dir=str(tmp_path / "w"))
    try:
        with pytest.raises(ValueError, match=r"W&B could not start the run of --wandb-project 'llama': .*API key.*"
                                             r"set WANDB_MODE=offline"):
            open_writers(logging, None, config={})
    finally:
        wandb.teardown()


@pytest.mark.multiprocess
def test_writers_the_last_rank_cannot_open_stop_every_rank(tiny_corpus, tmp_path, monkeypatch):
    _no_wandb_login(monkeypatch, tmp_path)
    argv = tiny_argv(tiny_corpus, wandb_project="llama", wandb_save_dir=str(tmp_path / "w"))
    first, last = run_distributed(pretrain_error, world_size=2, args=(argv,))
    assert last.startswith("W&B could not start the run of --wandb-project 'llama'"), last
    assert first == "the last rank (1) could not open its TensorBoard / W&B writers (its error is printed beside this one)"

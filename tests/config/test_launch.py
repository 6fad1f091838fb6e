"""detect_launch: who this process is, from torchrun's, SLURM's or no launcher's environment; planned_world_size:
how many processes a launch from this environment will make (--dry-run)."""

import pytest

from megatron.config.launch import LaunchInfo, detect_launch, first_slurm_host, planned_world_size


def test_world_size_prefers_world_size_then_slurm():
    assert detect_launch({"WORLD_SIZE": "16", "SLURM_NTASKS": "2"}).world_size == 16
    assert detect_launch({"SLURM_NTASKS": "8"}).world_size == 8
    assert detect_launch({}).world_size == 1


def test_a_non_integer_names_the_variable():
    with pytest.raises(ValueError, match="WORLD_SIZE='sixteen' is not an integer"):
        detect_launch({"WORLD_SIZE": "sixteen"})
    with pytest.raises(ValueError, match="SLURM_NTASKS='8x' is not an integer"):
        detect_launch({"SLURM_NTASKS": "8x"})


def test_torchrun_under_srun_uses_torchruns_variables():
    env = {"WORLD_SIZE": "384", "RANK": "13", "LOCAL_RANK": "5", "MASTER_ADDR": "node7", "MASTER_PORT": "6000",
           "SLURM_NTASKS": "48", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    assert detect_launch(env) == LaunchInfo(13, 384, 5, "node7", 6000, "torchrun")


def test_srun_one_task_per_gpu():
    env = {"SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123",
           "SLURM_JOB_NODELIST": "gpu[003-004,010]"}
    assert detect_launch(env) == LaunchInfo(9, 16, 1, "gpu003", 20123, "slurm")


def test_a_plain_process_is_a_world_of_one_and_ignores_a_lone_rank():
    assert detect_launch({"RANK": "3"}) == LaunchInfo(0, 1, 0, "127.0.0.1", None, "single")


def test_first_slurm_host():
    assert first_slurm_host("node[003-005,010],gpu7") == "node003"
    assert first_slurm_host("gpu7,gpu8") == "gpu7"
    assert first_slurm_host("login") == "login"


def test_planned_world_size_of_each_launch_style():
    assert planned_world_size({"WORLD_SIZE": "64", "SLURM_JOB_NUM_NODES": "8"}) == \
        (64, "WORLD_SIZE (torchrun / DeepSpeed launcher)")
    # BLOOM's sbatch: one task per node, each running torchrun --nproc_per_node $GPUS_PER_NODE
    bloom = {"SLURM_JOB_NUM_NODES": "48", "SLURM_NNODES": "48", "SLURM_NTASKS": "48", "SLURM_GPUS_ON_NODE": "8"}
    assert planned_world_size(bloom)[0] == 384
    assert planned_world_size(dict(bloom, GPUS_PER_NODE="4")) == \
        (192, "SLURM_JOB_NUM_NODES=48 x GPUS_PER_NODE=4 (one torchrun per node, as BLOOM's scripts)")
    assert planned_world_size({"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8"})[0] == 16  # the older name
    # srun with one task per GPU: the tasks are the ranks
    assert planned_world_size({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "16", "SLURM_GPUS_ON_NODE": "8"})[0] == 16
    assert planned_world_size({}) == (1, "no launcher in the environment (a world of one)")
    with pytest.raises(ValueError, match="neither GPUS_PER_NODE nor SLURM_GPUS_ON_NODE is set"):
        planned_world_size({"SLURM_JOB_NUM_NODES": "48", "SLURM_NTASKS": "48"})

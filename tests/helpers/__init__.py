"""Code the test modules share; a test module imports shared code from here only (and from megatron.*,
megatron.testing among them), never from another test module (tests/test_import_rules.py checks it).
Fixtures live in tests/conftest.py.

    paths               REPO_ROOT, SHARED_DATA; make_read_only / make_writable
    training            train (a run_distributed target: one record per run), record_run, pretrain_error,
                        layout, assert_same_run, assert_continues, tensorboard_scalars,
                        to_universal / convert_to_universal (tools/convert_checkpoint/ds_to_universal.py)
    wandb_offline       a W&B offline run read back from its .wandb file (history, summary, config)
    reference_losses    the golden runs (tests/training/golden/) and their comparison
    inference           prompts, a fixed batch, train_and_evaluate (a training run that evaluates it)
    hf                  comparisons with transformers' models and tools/generate.py
    full_disk           a save that fails with ENOSPC (one rank's or a real full tmpfs) and the checks of what it leaves
    checkpoint          tiny model configs (POSITIONS: every model kind), random weights, checkpoints of them
    megatron_deepspeed  a BLOOM checkpoint as bigscience's Megatron-DeepSpeed writes one
    server              a generation server in a thread, tools/serve.py in a process, a blocking client
    model, parallel     tiny configs of the model tests; tensor-parallel workers on gloo (run_on_tp)
    engine              DeepSpeed's pipeline partitioning on our layer specs
    muon                Muon's plain-PyTorch reference and tolerance; the TP-mode check + training launch target
    arguments, config   command lines of the argument tests; RunConfigs built from the dataclasses
    data                a Hugging Face cache laid out by hand
    examples, tr11_jobs, slurm_cluster   the launch scripts' dry runs; BigScience's tr11 commands; a
                        single-node SLURM cluster on loopback
    netns_cluster       simulated nodes: a network namespace, address, hostname, /etc/hosts and /tmp each, one
                        bridge, a shared folder; run a command on a node, kill a node, cut or shape its link
    faults              faults injected on purpose (poisoned gradients, held or paused runs, killed ranks, ...)
"""

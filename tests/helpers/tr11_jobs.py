"""BigScience's tr11 training commands, as their sbatch scripts pass them to pretrain_gpt.py, with the
world size each launches (NNODES x GPUS_PER_NODE: one torchrun per node); only local paths are stand-ins.

Source: github.com/bigscience-workshop/bigscience (snapshot at 9e64edec2ad1fb9263bf39ba616a84ff64b4d947),
train/tr11-176B-ml/:

- ``tr11-176B-ml.slurm`` at ed196cd266b120f1ece3efea9a1319da161d8f4b (2022-06-19), the 48-node (384 GPU)
  script BLOOM-176B trained with, and at dc8d99ff23653ebef7cc6900c901833162ca19c9 (2022-07-07, the newest),
  which moved to 24 nodes and added ``--sync-tp-duplicated-parameters`` (otherwise the same);
- ``smaller_models/tr11b-1B3-ml.slurm``, ``tr11d-760M-ml.slurm``, ``tr11e-350M-ml.slurm`` at
  699b2af918511deeb3d10e2756738f62447a4f1b (2022-04-20): 4-GPU V100 nodes, fp16.

The templates below are the scripts' GPT_ARGS, OPTIMIZER_ARGS, EXIT_OPTS, OUTPUT_ARGS, DEEPSPEED_ARGS and
CMD, in their order, with the scripts' variable names; ``Tr11Job.values`` holds each script's settings.
The quotes of ``--pp-partition-method 'type:transformer|embedding'`` are the inner shell's (the scripts
run ``bash -c "$LAUNCHER ... $CMD"``): the process gets ``type:transformer|embedding``. Stand-ins (the
``paths`` of ``argv``): CHECKPOINT_PATH, TENSORBOARD_PATH, KILL_SWITCH_PATH, TRAIN_DATA_PATH and
VALID_DATA_PATH (the split files load_ratios_meg_ds_format.py writes; here two small datasets),
config_json (the script's JSON, written by ``write_ds_config``). TOKENIZER_NAME_OR_PATH is the scripts'
hub name, found in a local Hugging Face cache the test fills.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from megatron.testing.tiny_corpus import write_stand_in_dataset

TOKENIZER_NAME_OR_PATH = ("bigscience-catalogue-data-dev/byte-level-bpe-tokenizer-no-norm-250k-whitespace-and-"
                          "eos-regex-alpha-v3-dedup-lines-articles")

OPTIMIZER_ARGS = """
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --lr {LR} --min-lr {MIN_LR}
    --lr-decay-style cosine --lr-decay-samples {LR_DECAY_SAMPLES} --lr-warmup-samples {LR_WARMUP_SAMPLES}
    --clip-grad 1.0 --weight-decay 1e-1"""
EXIT_OPTS = "--exit-duration-in-mins 5990"
GPT_ARGS = """
    --pp-partition-method type:transformer|embedding --num-layers {NLAYERS} --hidden-size {NHIDDEN}
    --num-attention-heads {NHEADS} --seq-length {SEQ_LEN} --max-position-embeddings {SEQ_LEN}
    --micro-batch-size {MICRO_BATCH_SIZE} --rampup-batch-size {RAMPUP_BATCH_SIZE}
    --global-batch-size {GLOBAL_BATCH_SIZE} --train-samples {TRAIN_SAMPLES} --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path {TOKENIZER_NAME_OR_PATH} --init-method-std 0.0048 --embed-layernorm {SYNC_TP}
    {PRECISION} --seed 42 --position-embedding-type alibi {CHECKPOINT_ACTIVATIONS}
    --abort-on-unmet-fused-kernel-constraints {KILL_SWITCH} --pad-vocab-size-to 250880
    """ + OPTIMIZER_ARGS + " " + EXIT_OPTS
OUTPUT_ARGS = """
    --log-interval 1 --save-interval {SAVE_INTERVAL} --eval-interval 1000 --eval-iters 1
    --tensorboard-dir {TENSORBOARD_PATH} --tensorboard-queue-size 5 --log-timers-to-tensorboard
    --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard"""
DEEPSPEED_ARGS = ("--deepspeed --deepspeed_config {config_json} --zero-stage {ZERO_STAGE} "
                  "--deepspeed-activation-checkpointing")
CMD = ("--tensor-model-parallel-size {TP_SIZE} --pipeline-model-parallel-size {PP_SIZE} " + GPT_ARGS + OUTPUT_ARGS
       + """
    --save {CHECKPOINT_PATH} --load {CHECKPOINT_PATH} --train-weighted-split-paths-path {TRAIN_DATA_PATH}
    --valid-weighted-split-paths-path {VALID_DATA_PATH} {WORKERS} --data-impl mmap --distributed-backend nccl
    """ + DEEPSPEED_ARGS)

# The scripts' settings common to all five (TRAIN_SAMPLES: "450B tokens").
COMMON = {"SEQ_LEN": 2048, "TRAIN_SAMPLES": "220_000_000", "LR_DECAY_SAMPLES": "200_000_000",
          "LR_WARMUP_SAMPLES": "183_105", "ZERO_STAGE": 0, "SYNC_TP": "", "CHECKPOINT_ACTIVATIONS": "",
          "KILL_SWITCH": "", "WORKERS": "", "RAMPUP_BATCH_SIZE": "192 16 9_765_625",
          "TOKENIZER_NAME_OR_PATH": TOKENIZER_NAME_OR_PATH}
BLOOM_176B = dict(COMMON, TP_SIZE=4, PP_SIZE=12, MICRO_BATCH_SIZE=2, GLOBAL_BATCH_SIZE=2048, NHIDDEN=14336,
                  NLAYERS=70, NHEADS=112, SAVE_INTERVAL=100, LR="6e-5", MIN_LR="6e-6", PRECISION="--bf16",
                  CHECKPOINT_ACTIVATIONS="--checkpoint-activations",
                  KILL_SWITCH="--kill-switch-path {KILL_SWITCH_PATH}",
                  WORKERS="--num-workers 2 --valid-num-workers 0")
FP16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
        "initial_scale_power": 12}


@dataclasses.dataclass(frozen=True)
class Tr11Job:
    name: str
    script: str                 # path in bigscience-workshop/bigscience
    commit: str                 # the commit its flags were read at
    nodes: int                  # #SBATCH --nodes (NNODES=$SLURM_NNODES)
    gpus_per_node: int          # GPUS_PER_NODE (#SBATCH --gres=gpu:N)
    values: dict                # the script's variables

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def ds_config(self) -> dict:
        """The JSON the script writes (``cat <<EOT > $config_json``)."""
        v = self.values
        precision = {"bf16": {"enabled": True}} if v["PRECISION"] == "--bf16" else {"fp16": FP16}
        return {"train_micro_batch_size_per_gpu": v["MICRO_BATCH_SIZE"], "train_batch_size": v["GLOBAL_BATCH_SIZE"],
                "gradient_clipping": 1.0, "zero_optimization": {"stage": v["ZERO_STAGE"]}, **precision,
                "steps_per_print": 2000, "wall_clock_breakdown": False}

    def argv(self, paths: dict) -> list[str]:
        """The flags the script passes, with ``paths`` (CHECKPOINT_PATH, TENSORBOARD_PATH, KILL_SWITCH_PATH,
        TRAIN_DATA_PATH, VALID_DATA_PATH, config_json) for its local files."""
        fields = dict(self.values, **paths)
        fields["KILL_SWITCH"] = fields["KILL_SWITCH"].format(**paths)
        return CMD.format(**fields).split()


TR11 = "train/tr11-176B-ml"
JOBS = {
    "176B-48nodes": Tr11Job("176B-48nodes", f"{TR11}/tr11-176B-ml.slurm", "ed196cd266b120f1ece3efea9a1319da161d8f4b",
                            48, 8, BLOOM_176B),
    "176B-24nodes": Tr11Job("176B-24nodes", f"{TR11}/tr11-176B-ml.slurm", "dc8d99ff23653ebef7cc6900c901833162ca19c9",
                            24, 8, dict(BLOOM_176B, SYNC_TP="--sync-tp-duplicated-parameters")),
    "1B3": Tr11Job("1B3", f"{TR11}/smaller_models/tr11b-1B3-ml.slurm", "699b2af918511deeb3d10e2756738f62447a4f1b",
                   16, 4, dict(COMMON, TP_SIZE=2, PP_SIZE=2, MICRO_BATCH_SIZE=1, GLOBAL_BATCH_SIZE=512, NLAYERS=24,
                               NHIDDEN=2048, NHEADS=16, SAVE_INTERVAL=250, LR="2e-4", MIN_LR="1e-5", PRECISION="--fp16",
                               CHECKPOINT_ACTIVATIONS="--checkpoint-activations")),
    "760M": Tr11Job("760M", f"{TR11}/smaller_models/tr11d-760M-ml.slurm", "699b2af918511deeb3d10e2756738f62447a4f1b",
                    8, 4, dict(COMMON, TP_SIZE=1, PP_SIZE=2, MICRO_BATCH_SIZE=1, GLOBAL_BATCH_SIZE=256, NLAYERS=24,
                               NHIDDEN=1536, NHEADS=16, SAVE_INTERVAL=250, LR="2.5e-4", MIN_LR="1e-5",
                               PRECISION="--fp16")),
    "350M": Tr11Job("350M", f"{TR11}/smaller_models/tr11e-350M-ml.slurm", "699b2af918511deeb3d10e2756738f62447a4f1b",
                    8, 4, dict(COMMON, TP_SIZE=1, PP_SIZE=1, MICRO_BATCH_SIZE=1, GLOBAL_BATCH_SIZE=256, NLAYERS=24,
                               NHIDDEN=1024, NHEADS=16, SAVE_INTERVAL=250, LR="3.0e-4", MIN_LR="1e-5",
                               PRECISION="--fp16", RAMPUP_BATCH_SIZE="192 32 9_765_625")),
}


def write_job_files(job: Tr11Job, d: pathlib.Path) -> dict:
    """The stand-in files of ``job`` under ``d`` (data prefixes that exist, empty: only their existence is
    checked; the two split files; the script's DeepSpeed JSON); returns the ``paths`` of ``Tr11Job.argv``."""
    prefixes = [d / "data" / f"{name}_text_document" for name in ("roots_en", "roots_fr")]
    for prefix in prefixes:
        write_stand_in_dataset(prefix)
    (d / "train-splits.txt").write_text(f'"train: 0.6 0:0.95 {prefixes[0]}, 0.4 0:0.95 {prefixes[1]}"\n')
    (d / "valid-splits.txt").write_text(f'"valid_en: 1 0.95:1.0 {prefixes[0]}" "valid_fr: 1 0.95:1.0 {prefixes[1]}"\n')
    config_json = d / f"ds_config.{job.name}.json"
    config_json.write_text(json.dumps(job.ds_config(), indent=2))
    return {"CHECKPOINT_PATH": str(d / "checkpoints" / "main"), "TENSORBOARD_PATH": str(d / "tensorboard" / "main"),
            "KILL_SWITCH_PATH": str(d / "kill-switch-tr11-176B-exp1"), "TRAIN_DATA_PATH": str(d / "train-splits.txt"),
            "VALID_DATA_PATH": str(d / "valid-splits.txt"), "config_json": str(config_json)}

#!/usr/bin/env python
"""Evaluate a training checkpoint of any TP / PP with EleutherAI's lm-evaluation-harness (lm-eval 0.4.x).

    python tools/evaluate.py --load CKPT --tasks tiny_choice,tiny_last_word --include_path examples/eval_tasks \\
        --batch_size 8 --output_path results/ --tensorboard-dir runs/eval
    python tools/evaluate.py --load CKPT --tasks hellaswag,lambada_openai --num_fewshot 0   # from the HF cache
    torchrun --nproc_per_node 2 tools/evaluate.py --load CKPT --tasks ...   # the model split over 2 processes (TP)

The model is loaded as tools/generate.py loads it (merged from any TP / PP; under torchrun split again over
the processes' tensor-parallel group), with the tokenizer the checkpoint records unless the tokenizer flags
say otherwise. What the harness decides takes the harness's own names (``--tasks``, ``--include_path``,
``--num_fewshot``, ``--batch_size``, ``--limit``, ``--output_path``, ``--log_samples``, ``--gen_kwargs``,
``--seed``; hyphenated spellings too). Results: the harness's table on stdout, its JSON under
``--output_path``, and one tensorboard scalar per task and metric (``lm-eval/TASK/METRIC`` at the
checkpoint's iteration) with ``--tensorboard-dir``. The work is in ``megatron.evaluation``.
"""

import argparse
import json
import os
import re

from megatron.cli import add_model_args


def _harness_flag(parser, name: str, **kwargs) -> None:
    """--name_with_underscores (the harness's spelling) and --name-with-hyphens, one destination."""
    parser.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    harness = parser.add_argument_group("lm-evaluation-harness (its own flag names)")
    _harness_flag(harness, "tasks", required=True, help="comma-separated task names")
    _harness_flag(harness, "include_path", default=None, help="a folder of task YAMLs (searched before the built-in)")
    _harness_flag(harness, "num_fewshot", type=int, default=None, help="examples per prompt (default: the task's)")
    _harness_flag(harness, "batch_size", type=int, default=1, help="requests per forward")
    _harness_flag(harness, "limit", type=float, default=None, help="documents per task (a fraction when < 1)")
    _harness_flag(harness, "output_path", default=None, help="folder for the harness's results JSON")
    _harness_flag(harness, "log_samples", action="store_true", help="also write every document's responses")
    _harness_flag(harness, "gen_kwargs", default=None, help="key=value,... overriding the tasks' generation")
    _harness_flag(harness, "seed", type=int, default=1234, help="the harness's random seeds")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per forward (default: learned positions, else the training length)")
    parser.add_argument("--no-builtin-tasks", action="store_true",
                        help="look tasks up under --include_path only (skips indexing the harness's own)")
    parser.add_argument("--tensorboard-dir", default=None, help="write each task's metrics here as scalars")
    return parser.parse_args(argv)


def _iteration(load: str, tag) -> int:
    """The checkpoint's iteration (the tag global_stepN, or 'latest' names it); 0 when it says none."""
    if tag is None and os.path.isfile(os.path.join(load, "latest")):
        with open(os.path.join(load, "latest")) as f:
            tag = f.read().strip()
    match = re.search(r"(\d+)$", tag or "")
    return int(match.group(1)) if match else 0


def main(argv=None) -> int:
    from lm_eval.utils import make_table

    from megatron.evaluation import harness
    from megatron.evaluation.harness_model import MegatronLM
    from megatron.inference.tp import serving_device

    args = parse_args(argv)
    tasks = [task for task in args.tasks.split(",") if task]
    settings = harness.HarnessSettings(num_fewshot=args.num_fewshot, limit=args.limit, log_samples=args.log_samples,
                                       seed=args.seed, gen_kwargs=args.gen_kwargs).validate()
    manager = harness.task_manager(tasks, args.include_path, builtin=not args.no_builtin_tasks)
    state = _parallel_state()
    try:
        lm = MegatronLM.from_checkpoint(args.load, tag=args.tag, dtype=args.dtype, parallel_state=state,
                                        device=serving_device(), batch_size=args.batch_size, max_length=args.max_length,
                                        tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                                        merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                                        tokenizer_name_or_path=args.tokenizer_name_or_path)
        results = harness.run_tasks(lm, tasks, manager, settings)
    finally:
        if state is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    if state is not None and state.rank != 0:
        return 0
    if args.tensorboard_dir:
        harness.write_tensorboard(harness.headline_metrics(results), args.tensorboard_dir,
                                  _iteration(args.load, args.tag))
    print(make_table(results))
    if args.output_path:
        results["config"].update(model="megatron", model_args={"load": args.load, "tag": args.tag, "dtype": args.dtype})
        harness.save_results(results, args.output_path, args.load)
    else:
        print(json.dumps(harness.headline_metrics(results), indent=1))
    return 0


def _parallel_state():
    """Under torchrun (WORLD_SIZE > 1): one tensor-parallel group of every process; else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch

    from megatron.parallel.state import ParallelState
    from megatron.training.distributed import init_process_group  # the training jobs' own join

    info = init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return ParallelState.create(tp=info.world_size, pp=1, dp=1)


if __name__ == "__main__":
    from megatron.cli import run_tool

    run_tool(main)

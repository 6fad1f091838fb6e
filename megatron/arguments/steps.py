"""``STEPS``: the argument pipeline, declared once, in order, from the parsed flags to a validated RunConfig.

Each step has a name (what the dry run's "not checked" lines say), the steps whose output it reads
(``needs``), the fields it fills in (``produces``: attributes of the Namespace, or of the ``Run`` for the
config steps) and its function. ``megatron.arguments.runner`` runs the list, stopping at the first problem
(a real launch) or collecting them all (``--dry-run``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

from megatron.arguments import (
    flag_steps,
    fp8_flags,
    interleaved_flags,
    mla_flags,
    moe_flags,
    upstream_flags,
    yarn_flags,
)
from megatron.arguments.build import assemble_run_config, resolve_vocab_size
from megatron.config import RunConfig
from megatron.config.deepspeed import build_deepspeed_config
from megatron.data.checks import index_problems, token_id_problems
from megatron.data.tokenizers import build_tokenizer


class Problems(ValueError):
    """Several independent problems of one step, found in collect mode (``Run.each``)."""

    def __init__(self, messages: Sequence[str]):
        super().__init__("; ".join(messages))
        self.messages = list(messages)


@dataclasses.dataclass
class Run:
    """What the steps read and write. ``launch``: the job's (world size, rank), asked by the world-size step
    (a real launch: the launcher's; the dry run: --world-size or the planned one). ``collect``: record every
    problem instead of raising the first. ``stand_in_splits``: splits whose groups stand in for a split file the
    dry run could not read (their data files are not looked for)."""

    args: argparse.Namespace
    launch: Callable[[], tuple[int, int]]
    collect: bool = False
    with_vocab: bool = True
    tokenizer: Any = None   # anything with vocab_size (and eod); None: built from the flags
    stand_in_splits: tuple[str, ...] = ()
    config: Optional[RunConfig] = None

    def each(self, checks: Sequence[Callable[[], Any]]) -> None:
        """Independent checks of one step: the first ValueError is raised, or in collect mode every one is
        (as ``Problems``)."""
        found = []
        for check in checks:
            try:
                check()
            except ValueError as error:
                if not self.collect:
                    raise
                found.append(str(error))
        if found:
            raise Problems(found)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: ``run`` raises ValueError for what it finds wrong (or ``Problems`` through ``Run.each``)."""

    name: str
    run: Callable[[Any], None]
    needs: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()
    on: str = "args"                                 # what ``run`` takes: the Namespace ("args") or the Run ("run")
    when: Optional[Callable[[Run], bool]] = None     # None: always; else the step runs only when this says so


# ---- the steps that take the Run


def _world_size(run: Run) -> None:
    run.args.world_size, run.args.rank = run.launch()


def _data_files(run: Run) -> None:
    """Each pair is there, and opens: its index whole and describing exactly its .bin (a truncated .bin)."""
    flag_steps.check_data_files(run.args, run.stand_in_splits)
    problems = index_problems(flag_steps.data_prefixes(run.args, run.stand_in_splits))
    if problems:
        raise Problems(problems) if run.collect else ValueError(problems[0])


def _token_ids(run: Run) -> None:
    """The data's token ids (a bounded scan: megatron.data.checks) are below the tokenizer's vocabulary."""
    problems = token_id_problems(flag_steps.data_prefixes(run.args, run.stand_in_splits), run.tokenizer.vocab_size)
    if problems:
        raise Problems(problems) if run.collect else ValueError(problems[0])


def _training_documents(run: Run) -> None:
    flag_steps.check_training_documents(run.args, run.stand_in_splits)


def _assemble(run: Run) -> None:
    run.config = assemble_run_config(run.args)


def _settings(run: Run) -> None:
    """Each settings dataclass's own ``validate()``, one by one (the model with a stand-in vocabulary while the
    tokenizer's is not known)."""
    c = run.config
    tp, dp = c.parallel.tensor_model_parallel_size, c.parallel.data_parallel_size
    model = c.model if c.model.padded_vocab_size is not None else dataclasses.replace(c.model, padded_vocab_size=tp)
    parts = (c.parallel, c.optimizer, c.lr_schedule, c.precision, c.data, c.training, c.logging, c.checkpoint, c.exit)
    run.each([part.validate for part in parts] + [functools.partial(model.validate, tp),
                                                  functools.partial(c.batch.validate, dp)])


def _deepspeed_merge(run: Run) -> None:
    build_deepspeed_config(run.config, run.config.deepspeed_user_config)  # a JSON contradicting the flags fails


def _across_settings(run: Run) -> None:
    run.config.validate()


def _tokenizer(run: Run) -> None:
    if run.tokenizer is not None:
        return
    tokenizer = run.config.data.tokenizer
    try:
        run.tokenizer = build_tokenizer(tokenizer)
    except ValueError:
        raise
    except Exception as error:  # a broken file raises whatever its library raises
        raise ValueError(f"the tokenizer ({tokenizer.tokenizer_type}) could not be built: "
                         f"{type(error).__name__}: {error}") from error


def _padded_vocabulary(run: Run) -> None:
    run.config = resolve_vocab_size(run.config, run.tokenizer)


def _vocabulary_wanted(run: Run) -> bool:
    return run.with_vocab


# ---- the pipeline

WORLD = "the world size"
FLAG_STEPS = (
    Step("the dry-run options", flag_steps.check_dry_run_flags),
    Step(WORLD, _world_size, produces=("world_size", "rank"), on="run"),
    Step("the required flags", flag_steps.check_required),
    Step("the Megatron flags refused here", upstream_flags.check_upstream_flags),
    Step("the model flags spelled two ways", flag_steps.resolve_model_spellings,
         produces=("position_embedding_type", "position_embedding_yarn", "num_key_value_heads", "attention_backend",
                   "attention_backend_alias")),
    Step("the Megatron-LM values that must match this engine's", flag_steps.check_megatron_lm_values,
         needs=("the required flags",)),
    Step("the mixture-of-experts flags", moe_flags.resolve_moe, needs=("the required flags",), produces=("moe",)),
    Step("the recomputation flags", flag_steps.resolve_recompute_spellings,
         produces=("recompute_core_attention", "recompute_module_parts", "checkpoint_activations",
                   "checkpoint_num_layers")),
    Step("the parallel sizes against the world size", flag_steps.derive_parallel, needs=(WORLD,),
         produces=("data_parallel_size",)),
    Step("the virtual pipeline stages", interleaved_flags.resolve_virtual_stages, needs=("the required flags",),
         produces=("num_virtual_stages_per_pipeline_rank",)),
    Step("the multi-head latent attention flags", mla_flags.resolve_mla,
         produces=("mla",)),
    Step("the YaRN flags", yarn_flags.resolve_yarn, needs=("the model flags spelled two ways",), produces=("yarn",)),
    Step("the FP8 flags", fp8_flags.resolve_fp8, needs=("the required flags",), produces=("fp8",)),
    Step("the defaults", flag_steps.fill_defaults, produces=("distributed_backend", "profile_ranks")),
    Step("the skipped iteration ranges", flag_steps.merge_iteration_ranges, produces=("skip_train_iteration_range",)),
    Step("the data flags", flag_steps.parse_data_flags,
         produces=("data_path_pairs", "split", "train_weighted_split_groups", "valid_weighted_split_groups",
                   "test_weighted_split_groups")),
    Step("the data files", _data_files, needs=("the data flags",), on="run"),
    Step("the training split's documents", _training_documents, needs=("the data files",), on="run"),
    Step("the tokenizer files", flag_steps.check_tokenizer_files),
    Step("the output folders", flag_steps.check_output_folders),
    Step("the DeepSpeed JSON", flag_steps.load_deepspeed_json, produces=("deepspeed_user_config", "zero_stage")),
    Step("the startup warnings", flag_steps.collect_startup_warnings,
         needs=("the model flags spelled two ways", "the recomputation flags", "the defaults", "the DeepSpeed JSON"),
         produces=("startup_warnings",)),
)
SETTINGS = "the settings' own rules (model, parallel layout, batch, optimizer, schedule, ...)"
JSON_MERGE = "the DeepSpeed JSON against the flags"
ACROSS_SETTINGS = "the rules across settings (pipeline stages vs layers, schedule vs run length, validation data)"
VOCABULARY = "the padded vocabulary"
CONFIG_STEPS = (
    # every flag step that fills in a field the run configuration reads, in the order they run
    Step("the run configuration", _assemble, on="run", produces=("config",),
         needs=(WORLD, "the required flags", "the model flags spelled two ways", "the mixture-of-experts flags",
                "the multi-head latent attention flags", "the YaRN flags", "the FP8 flags",
                "the recomputation flags",
                "the parallel sizes against the world size", "the defaults", "the skipped iteration ranges",
                "the data flags", "the DeepSpeed JSON", "the startup warnings")),
    Step(SETTINGS, _settings, needs=("the run configuration",), on="run"),
    Step(JSON_MERGE, _deepspeed_merge, needs=("the run configuration",), on="run"),
    Step(ACROSS_SETTINGS, _across_settings, needs=(SETTINGS, JSON_MERGE), on="run"),
    Step("the tokenizer", _tokenizer, needs=("the tokenizer files", SETTINGS), on="run", produces=("tokenizer",),
         when=_vocabulary_wanted),
    Step("the data's token ids against the vocabulary", _token_ids, needs=("the data flags", "the tokenizer"),
         on="run", when=_vocabulary_wanted),
    Step(VOCABULARY, _padded_vocabulary, needs=(ACROSS_SETTINGS, "the tokenizer"), on="run", produces=("config",),
         when=_vocabulary_wanted),
)
STEPS = FLAG_STEPS + CONFIG_STEPS

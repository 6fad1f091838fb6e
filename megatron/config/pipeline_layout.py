"""Which layers each pipeline stage holds when the run says so: Megatron-LM's pipeline layout flags.

    --pipeline-model-parallel-layout STR          every (virtual) stage's layers spelled out
    --decoder-first-pipeline-num-layers N         the first pipeline rank's transformer layers (the rest even)
    --decoder-last-pipeline-num-layers N          the last pipeline rank's
    --account-for-embedding-in-pipeline-split     the embedding weighs as one transformer layer in the even split
    --account-for-loss-in-pipeline-split          the loss (final norm and output head) weighs as one

``stage_contents`` turns whichever is given into one ``StageContents`` per virtual stage, in Megatron-LM's order:
virtual stage ``s`` is chunk ``s // PP`` of pipeline rank ``s % PP`` (with one virtual stage per rank, just the
ranks), and the stages hold the layers in order. Without any of these flags it returns None: DeepSpeed's
``--pp-partition-method`` splits the layers. ``item_bounds`` gives the pipeline engine's ``parts`` for those
contents, ``rank_layers`` each pipeline rank's transformer layers (what the planner and ``--dry-run`` count).

The layout string (Megatron-LM's meaning, parsed here): ``E`` the embedding, ``t`` a transformer layer, ``m`` a
multi-token-prediction layer, ``L`` the loss (final norm, output head, loss), ``|`` between stages, ``,`` only for
reading; ``X*N`` repeats one character and ``(...)*N`` a group (groups may nest), e.g. DeepSeek-V3's
``Et|(tt|)*30mL``. With virtual stages the string lists PP x v stages, rank 0's first chunk, rank 1's first chunk,
..., then every rank's second chunk. ``E`` comes first and ``L`` last, once each.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

__all__ = ["StageContents", "parse_layout", "layout_stage_count", "stage_contents", "rank_layers", "item_bounds",
           "describe", "LAYOUT_FLAGS", "LAYOUT_FIELDS"]

LAYOUT_FLAGS = ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split")
LAYOUT_FIELDS = ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")  # the ParallelConfig fields of LAYOUT_FLAGS
_LAYER_CHARS = {"E": "the embedding", "t": "a transformer layer", "m": "an MTP layer", "L": "the loss"}


@dataclasses.dataclass(frozen=True)
class StageContents:
    """What one (virtual) pipeline stage holds, in this order: the embedding, transformer layers, MTP layers,
    the loss (the final norm and the output head)."""

    embedding: bool = False
    layers: int = 0
    mtp: int = 0
    loss: bool = False

    @property
    def empty(self) -> bool:
        return not (self.embedding or self.layers or self.mtp or self.loss)


# ---- the layout string ------------------------------------------------------------------------------------


class _Reader:
    """A recursive-descent reader of the layout grammar: sequence := (unit ['*' count])*, unit := char | '(' sequence
    ')'. Returns the unrolled characters, separators included."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self, why: str) -> ValueError:
        return ValueError(f"--pipeline-model-parallel-layout {self.text!r}: {why} (at character {self.pos + 1}); "
                          f"write it with E, t, m, L, '|' between stages, X*N or (...)*N for repeats, as in "
                          f"Megatron-LM, e.g. 'Et|(tt|)*30mL'")

    def sequence(self, closing: Optional[str] = None) -> str:
        out = []
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == ")":
                if closing is None:
                    raise self.fail("a ')' without its '('")
                return "".join(out)
            if char == ",":
                self.pos += 1
                continue
            if char == "(":
                self.pos += 1
                unit = self.sequence(closing=")")
                if self.pos >= len(self.text):
                    raise self.fail("a '(' without its ')'")
                self.pos += 1
                if not unit:
                    raise self.fail("an empty group '()'")
            elif char in _LAYER_CHARS or char == "|":
                unit = char
                self.pos += 1
            else:
                raise self.fail(f"{char!r} is not a layer ({', '.join(f'{c} {w}' for c, w in _LAYER_CHARS.items())}) "
                                f"nor a separator")
            out.append(unit * self.count())
        if closing is not None:
            raise self.fail("a '(' without its ')'")
        return "".join(out)

    def count(self) -> int:
        if self.pos >= len(self.text) or self.text[self.pos] != "*":
            return 1
        self.pos += 1
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        if start == self.pos:
            raise self.fail("'*' must be followed by a repeat count")
        return int(self.text[start:self.pos])


def parse_layout(text: str) -> list[str]:
    """The stages of a layout string, each the string of its layer characters in order (``''``: an empty stage).
    E.g. ``'E|(tt|)*2,L'`` -> ``['E', 'tt', 'tt', 'L']``. Only the spelling is checked here; ``stage_contents``
    checks the stages against the model and the parallel sizes."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"--pipeline-model-parallel-layout must be a non-empty string, got {text!r}")
    return _Reader(text).sequence().split("|")


def layout_stage_count(text: str) -> int:
    """How many stages (PP x virtual stages) the layout string lists."""
    return len(parse_layout(text))


def _contents_of_string(text: str, num_layers: int, pp: int, mtp_num_layers: int) -> tuple[StageContents, ...]:
    stages = parse_layout(text)
    flag = f"--pipeline-model-parallel-layout {text!r}"
    if len(stages) % pp:
        raise ValueError(f"{flag} lists {len(stages)} stages, not a multiple of --pipeline-model-parallel-size {pp}: "
                         f"it lists PP x virtual stages per rank, separated by '|'")
    flat = "".join(stages)
    if flat.count("E") != 1 or not flat.startswith("E"):
        raise ValueError(f"{flag}: the embedding E must come once, first (it has {flat.count('E')}, the first layer "
                         f"is {flat[:1] or 'none'})")
    if flat.count("L") != 1 or not flat.endswith("L"):
        raise ValueError(f"{flag}: the loss L must come once, last (it has {flat.count('L')}, the last layer is "
                         f"{flat[-1:] or 'none'})")
    if flat.count("t") != num_layers:
        raise ValueError(f"{flag} places {flat.count('t')} transformer layers (t), but --num-layers is {num_layers}")
    if flat.count("m") != mtp_num_layers:
        raise ValueError(f"{flag} places {flat.count('m')} multi-token-prediction layers (m), but --mtp-num-layers is "
                         f"{mtp_num_layers}: place one m per MTP depth, on the stage of the loss (L)")
    if any("m" in stage and "L" not in stage for stage in stages):
        raise ValueError(f"{flag}: the MTP layers (m) must share the last stage with the loss (L): the depths run in "
                         f"the loss function here (megatron.model.mtp), on the stage that holds the labels; Megatron-LM "
                         f"also lets them stand alone on a stage before it, which is not built")
    return tuple(StageContents(embedding="E" in s, layers=s.count("t"), mtp=s.count("m"), loss="L" in s)
                 for s in stages)


# ---- the even forms ------------------------------------------------------------------------------------------


def _uneven_rank_layers(num_layers: int, pp: int, vp: int, first: Optional[int], last: Optional[int]) -> list[int]:
    """Transformer layers per pipeline rank with ``--decoder-first/last-pipeline-num-layers`` (Megatron-LM's rule: the
    given ranks take their counts, the ranks between share the rest evenly; every count divides into v chunks)."""
    if pp < 2:
        raise ValueError("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers set the first / "
                         "last of several pipeline ranks: use --pipeline-model-parallel-size 2 or more, or drop them")
    counts: list[Optional[int]] = [None] * pp
    for flag, rank, value in (("--decoder-first-pipeline-num-layers", 0, first),
                              ("--decoder-last-pipeline-num-layers", pp - 1, last)):
        if value is None:
            continue
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive number of layers, got {value!r}")
        if value % vp:
            raise ValueError(f"{flag} {value} does not divide into the {vp} virtual stages of its rank: use a "
                             f"multiple of {vp}")
        counts[rank] = value
    middle = [r for r in range(pp) if counts[r] is None]
    rest = num_layers - sum(c for c in counts if c is not None)
    given = " + ".join(str(c) for c in counts if c is not None)
    if rest < 0 or (rest > 0) != bool(middle):
        raise ValueError(f"--num-layers {num_layers} does not match the first / last pipeline ranks' {given} layers "
                         f"with {len(middle)} ranks between them to take the other {rest}")
    if middle and rest % (len(middle) * vp):
        raise ValueError(f"the {rest} layers left for the {len(middle)} pipeline ranks between the first and the last "
                         f"do not split evenly into {len(middle)} x {vp} virtual stages: change "
                         f"--decoder-first/last-pipeline-num-layers or --num-layers")
    for r in middle:
        counts[r] = rest // len(middle)
    return counts


def stage_contents(num_layers: int, pp: int, vp: int = 1, *, layout: Optional[str] = None,
                   first: Optional[int] = None, last: Optional[int] = None, account_for_embedding: bool = False,
                   account_for_loss: bool = False, mtp_num_layers: int = 0) -> Optional[tuple[StageContents, ...]]:
    """The contents of the PP x ``vp`` virtual stages (Megatron-LM's order, see the module docstring) that the
    layout flags give, or None when none of them is set (``--pp-partition-method`` decides). ValueError naming
    the flag and the fix for a layout that does not fit ``num_layers`` layers on ``pp`` x ``vp`` stages."""
    asked = [flag for flag, on in zip(LAYOUT_FLAGS, (layout is not None, first is not None, last is not None,
                                                      account_for_embedding, account_for_loss)) if on]
    if not asked:
        return None
    if layout is not None:
        if len(asked) > 1:
            raise ValueError(f"--pipeline-model-parallel-layout spells out every stage; it cannot be combined with "
                             f"{', '.join(asked[1:])} (as in Megatron-LM): drop one")
        stages = _contents_of_string(layout, num_layers, pp, mtp_num_layers)
        if len(stages) != pp * vp:
            raise ValueError(f"--pipeline-model-parallel-layout {layout!r} lists {len(stages)} stages; "
                             f"--pipeline-model-parallel-size {pp} x {vp} virtual stages per rank needs {pp * vp}")
        return stages
    if first is not None or last is not None:
        if account_for_embedding or account_for_loss:
            raise ValueError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                             "--account-for-embedding/loss-in-pipeline-split (as in Megatron-LM): drop one")
        per_chunk = [n // vp for n in _uneven_rank_layers(num_layers, pp, vp, first, last)]
        layers = [per_chunk[s % pp] for s in range(pp * vp)]
        extra_e, extra_l = 0, 0
    else:
        extra_e, extra_l = int(account_for_embedding), int(account_for_loss)
        total = num_layers + extra_e + extra_l
        if total % (pp * vp):
            counted = " + ".join([f"{num_layers} layers"] + ["the embedding"] * extra_e + ["the loss"] * extra_l)
            raise ValueError(f"{counted} = {total} do not split evenly into --pipeline-model-parallel-size {pp} x "
                             f"{vp} virtual stages = {pp * vp}: change --num-layers or the parallel sizes")
        layers = [total // (pp * vp)] * (pp * vp)
    layers[0] -= extra_e
    layers[-1] -= extra_l
    if min(layers) < 0:
        raise ValueError(f"the first or last stage would hold fewer than no transformer layers ({layers[0]}, "
                         f"{layers[-1]}): use fewer stages")
    return tuple(StageContents(embedding=s == 0, layers=n, loss=s == len(layers) - 1,
                               mtp=mtp_num_layers if s == len(layers) - 1 else 0)  # the depths: with the loss
                 for s, n in enumerate(layers))


# ---- what the engine, the planner and the dry run read -------------------------------------------------------


def rank_layers(stages: Sequence[StageContents], pp: int) -> list[int]:
    """Transformer layers on each pipeline rank: the sum over its chunks (virtual stages ``r, r + PP, ...``)."""
    return [sum(stage.layers for stage in stages[rank::pp]) for rank in range(pp)]


def item_bounds(stages: Sequence[StageContents], lead_items: int, tail_items: int) -> list[int]:
    """The pipeline engine's ``parts`` (stage ``s`` holds items ``parts[s] .. parts[s+1] - 1``) for these contents,
    on an item list of ``lead_items`` items up to and around the embedding, then one item per transformer layer,
    then ``tail_items`` for the loss (``megatron.model.layout.pipeline_items``: 3 and 3; with MTP the tail holds the
    depths' two items too, always on the loss's stage)."""
    parts = [0]
    for stage in stages:
        parts.append(parts[-1] + lead_items * stage.embedding + stage.layers + tail_items * stage.loss)
    return parts


def describe(stage: StageContents) -> str:
    """A stage in the layout's own letters, e.g. ``E,t*2`` (``(empty)`` for none)."""
    parts = (["E"] if stage.embedding else []) + ([f"t*{stage.layers}" if stage.layers > 1 else "t"]
                                                  if stage.layers else [])
    parts += ([f"m*{stage.mtp}" if stage.mtp > 1 else "m"] if stage.mtp else []) + (["L"] if stage.loss else [])
    return ",".join(parts) or "(empty)"

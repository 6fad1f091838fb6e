"""Every way a run saves x every reader of its checkpoint: each pair works, or is refused before any work.

Saving layouts (LAYOUTS): 3D (TP=2 x PP=2) at ZeRO-0 and ZeRO-1, ZeRO-2 and ZeRO-3 (TP=2 x DP=2), ZeRO-3 with
hpZ groups of 2 (DP=4), Megatron's --sequence-parallel (3D), DeepSpeed-Ulysses (SP=2) at ZeRO-0, 1, 2 and 3, and a
Llama-style model (rotary, RMSNorm, SwiGLU, GQA, untied head) in 3D and at ZeRO-3. Readers:

- resume: ``--load`` into the same layout; the next step's loss equals the uninterrupted run's, bit for bit;
- merger: ``load_full_state_dict`` gives the live model's weights, bit for bit;
- ds_to_universal.py: the converted ``zero/`` folders hold the live weights under the engine's names;
- to_hf.py: transformers' logits equal the live weights' (one GPTModel) logits within the fp32 tolerance;
- generate.py: its greedy text equals the live weights' greedy decode (recomputed every step, no KV cache);
- serve.py: the generator its loading path builds, served on a free port, answers /generate with that text.

"The live model" is the engine's module at the end of training: each rank hands back its parameters (ZeRO-3's
gathered over the data-parallel ranks), and the TP shards are put together here, checking that replicated ones
agree. A refused pair (REFUSED) must raise before it writes anything, with a message naming the reason.

One 4-rank and one 2-rank launch train every layout 2 iterations (saving at 1 and 2), one more of each resumes
every layout from its iteration-1 checkpoint; each (layout, reader) test then runs in this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import urllib.request

import deepspeed
import pytest
import torch

from megatron.arguments import run_config_from_argv
from megatron.checkpoint.run_state import load_run_state, reader_for
from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.single_process import load_full_state_dict
from megatron.checkpoint.tp_shards import merge_tp_shards
from megatron.checkpoint.universal.engines import folder_names
from megatron.config import ModelConfig, TokenizerConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.inference.generation import SamplingParams, generate_token_ids
from megatron.inference.server import ServerLimits, make_server
from megatron.model import GPTModel
from megatron.model.layout import TIED_MODULE_PREFIX, model_name, parameter_layout
from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import model_tolerance
from megatron.training.pretrain import pretrain, resume_point
from tools import generate, serve
from tools.convert_checkpoint import ds_to_universal, to_hf

ITERS = 2
VOCAB = 400  # the tiny corpus's tokenizer; padded to 512 rows
LLAMA = ("--normalization", "rmsnorm", "--swiglu", "--num-attention-heads", "8", "--num-key-value-heads", "4",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96")
LLAMA_FLAGS = dict(position_embedding_type="rope", embed_layernorm=False)
THREE_D = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way a run saves: its world size and flags (tiny_argv's keywords, then verbatim ones)."""

    world_size: int
    flags: dict
    extra: tuple = ()

    @property
    def tp(self) -> int:
        return self.flags.get("tensor_model_parallel_size", 1)

    @property
    def sp(self) -> int:
        return self.flags.get("ds_sequence_parallel_size", 1)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.flags.get("pipeline_model_parallel_size", 1) * self.sp)

    def argv(self, corpus, **more) -> list[str]:
        # A wide init (std 0.3), so that greedy continuations differ between prompts.
        flags = dict(self.flags, train_iters=ITERS, lr_warmup_iters=1, init_method_std=0.3, **more)
        return tiny_argv(corpus, *self.extra, **flags)


LAYOUTS = {
    "3d-zero0": Layout(4, dict(THREE_D, zero_stage=0)),
    "3d-zero1": Layout(4, dict(THREE_D, zero_stage=1)),
    "zero2": Layout(4, dict(tensor_model_parallel_size=2, zero_stage=2)),  # DP = 2
    "zero3": Layout(4, dict(tensor_model_parallel_size=2, zero_stage=3)),
    "hpz": Layout(4, dict(zero_stage=3, zero_hpz_partition_size=2)),  # DP = 4: TP = 1's flat partitions
    "megatron-sp": Layout(4, dict(THREE_D, zero_stage=1, sequence_parallel=True)),
    "llama-3d": Layout(4, dict(THREE_D, zero_stage=1, **LLAMA_FLAGS), LLAMA),
    "llama-zero3": Layout(4, dict(tensor_model_parallel_size=2, zero_stage=3, **LLAMA_FLAGS), LLAMA),
    "ulysses-zero0": Layout(2, dict(ds_sequence_parallel_size=2, zero_stage=0)),
    "ulysses-zero1": Layout(2, dict(ds_sequence_parallel_size=2, zero_stage=1)),
    "ulysses-zero2": Layout(2, dict(ds_sequence_parallel_size=2, zero_stage=2)),
    "ulysses-zero3": Layout(2, dict(ds_sequence_parallel_size=2, zero_stage=3)),
}
READERS = ("resume", "merger", "ds_to_universal", "to_hf", "generate", "serve")
# (layout, reader): (exception type, a phrase of its message). Every other pair works.
UNPARTITIONED = (ValueError, r"saved at --zero-stage 0: it holds no ZeRO optimizer partitions.*--zero-stage 1 or above")
REFUSED: dict[tuple[str, str], tuple[type, str]] = {("3d-zero0", "ds_to_universal"): UNPARTITIONED,
                                                    ("ulysses-zero0", "ds_to_universal"): UNPARTITIONED}
PROMPTS = ["The river", "Model data train the", "North city music"]
NEW_TOKENS = 8


def _live_weights(engine, config) -> dict:
    """{GPTModel name: this rank's part} of the engine's module (ZeRO-3: gathered over the data-parallel ranks),
    as numpy arrays (a tensor would travel as shared memory of a process that has exited)."""
    def gpt_name(name):  # the pipeline module's names: "3.mlp...", "tied_modules.embed..."
        pipeline = name.startswith(TIED_MODULE_PREFIX) or name.split(".")[0].isdigit()
        return model_name(name, config) if pipeline else name

    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):  # a no-op below ZeRO-3
        return {gpt_name(name): p.detach().numpy().copy() for name, p in named}


def _train(rank, world_size, runs, capture):
    """Each argv of ``runs`` in turn: {iteration: loss}, and (``capture``) this rank's live weights."""
    out = []
    for argv in runs:
        rc = run_config_from_argv(argv, world_size=world_size)
        result = pretrain(rc)
        out.append({"losses": {r.iteration: r.loss for r in result.history},
                    "weights": _live_weights(result.engine, rc.model) if capture else None})
    return out


def _merge_live(per_rank: list[dict], config, layout: Layout) -> dict[str, torch.Tensor]:
    """The TP=1 state dict of the ranks' live weights: data- and sequence-parallel rank 0's, every pipeline
    stage's, the TP shards put together (replicated ones checked equal). Ranks are numbered
    ((pipe * dp + data) * sp + seq) * tp + model."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for rank, weights in enumerate(per_rank):
        model, seq, data = rank % layout.tp, rank // layout.tp % layout.sp, rank // (layout.tp * layout.sp) % layout.dp
        if seq == 0 and data == 0:
            for name, array in weights.items():
                shards.setdefault(name, {})[model] = torch.from_numpy(array)
    params = parameter_layout(config)
    assert set(shards) == set(params), sorted(set(shards) ^ set(params))
    return {name: merge_tp_shards(params[name], [by_rank[t] for t in range(layout.tp)])
            for name, by_rank in shards.items()}


@dataclasses.dataclass
class Saved:
    """A layout's checkpoint folder and what the live run it came from held."""

    save: str
    argv: list
    config: ModelConfig  # the run's, for one process (no sequence split)
    losses: dict
    weights: dict


@pytest.fixture(scope="module")
def trained(tiny_corpus, tmp_path_factory) -> dict[str, Saved]:
    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for world in (4, 2):
        names = [name for name, layout in LAYOUTS.items() if layout.world_size == world]
        runs = [LAYOUTS[name].argv(tiny_corpus, save=str(root / name), save_interval=1) for name in names]
        per_rank = run_distributed(_train, world_size=world, args=(runs, True), timeout=900)
        for i, name in enumerate(names):
            config = run_config_from_argv(runs[i], world_size=world).model
            config = dataclasses.replace(config, sequence_parallel=False)
            out[name] = Saved(str(root / name), runs[i], config, per_rank[0][i]["losses"],
                              _merge_live([r[i]["weights"] for r in per_rank], config, LAYOUTS[name]))
    return out


@pytest.fixture(scope="module")
def resumed(trained, tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    """Each layout resumed from its iteration-1 checkpoint (a copy without the later one): {iteration: loss}."""
    root = tmp_path_factory.mktemp("resumed")
    out = {}
    for world in (4, 2):
        names = [name for name, layout in LAYOUTS.items() if layout.world_size == world
                 and (name, "resume") not in REFUSED]
        runs = []
        for name in names:
            copy = root / name
            shutil.copytree(trained[name].save, copy, ignore=shutil.ignore_patterns(f"global_step{ITERS}"))
            (copy / "latest").write_text("global_step1")
            runs.append(LAYOUTS[name].argv(tiny_corpus, load=str(copy)))
        if runs:
            per_rank = run_distributed(_train, world_size=world, args=(runs, False), timeout=900)
            out.update({name: per_rank[0][i]["losses"] for i, name in enumerate(names)})
    return out


class Live:
    """The live weights of each layout in one GPTModel, and what it computes (each once)."""

    def __init__(self, trained, corpus):
        self.trained, self._models, self._greedy = trained, {}, {}
        self.tokenizer = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=corpus["vocab_file"],
                                                         merge_file=corpus["merge_file"]))

    def model(self, name):
        if name not in self._models:
            model = GPTModel(self.trained[name].config).eval()
            model.load_state_dict(self.trained[name].weights)
            self._models[name] = model
        return self._models[name]

    def greedy(self, name) -> list[list[int]]:
        """Greedy continuations of PROMPTS, the whole sequence recomputed at every step."""
        if name not in self._greedy:
            params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
            self._greedy[name] = [generate_token_ids(self.model(name), self.tokenizer.tokenize(p), params,
                                                     vocab_size=VOCAB, eod=self.tokenizer.eod, use_cache=False)[0]
                                  for p in PROMPTS]
        return self._greedy[name]


@pytest.fixture(scope="module")
def live(trained, tiny_corpus) -> Live:
    return Live(trained, tiny_corpus)


def _resume(name, saved, live, out, request):
    # what pretrain() checks first, before any process group: a refusal is raised here
    argv = saved.argv + ["--load", saved.save]
    assert resume_point(run_config_from_argv(argv, world_size=LAYOUTS[name].world_size))[0] == f"global_step{ITERS}"
    resumed = request.getfixturevalue("resumed")
    assert resumed[name] == {ITERS: saved.losses[ITERS]}, (resumed[name], saved.losses)


def _merger(name, saved, live, out, request):
    _, state, _ = load_full_state_dict(saved.save)
    assert set(state) == set(saved.weights)
    for key, tensor in saved.weights.items():
        assert torch.equal(state[key], tensor), f"{name} {key}: max diff {(state[key] - tensor).abs().max()}"


def _universal(name, saved, live, out, request):
    tag = f"global_step{ITERS}"
    ds_to_universal.main(["--input_folder", os.path.join(saved.save, tag), "--output_folder",
                          os.path.join(out, tag + "_universal"), "--num_extract_workers", "1",
                          "--num_merge_workers", "1"])
    engine = reader_for(load_run_state(out, tag + "_universal"), universal=True)
    for folder, param in folder_names(saved.config, engine).items():
        loaded = safe_load(os.path.join(out, tag + "_universal", "zero", folder, "fp32.pt"))
        tensor = loaded["param"] if isinstance(loaded, dict) else loaded
        expected = saved.weights[param.name]
        assert torch.equal(tensor.reshape(expected.shape), expected), f"{name} {folder}"


def _to_hf(name, saved, live, out, request):
    from transformers import AutoModelForCausalLM  # heavy: only where a test exports

    assert to_hf.main(["--load", saved.save, "--output-dir", out]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))  # [b, s]
    with torch.no_grad():
        expected = live.model(name)(ids).transpose(0, 1)[..., :VOCAB]  # [b, s, v]
        diff = (hf(ids).logits - expected).abs().max().item()
    print(f"{name}: to_hf logits differ by {diff:.3g} (logits up to {expected.abs().max().item():.3g})")
    assert diff <= model_tolerance(saved.config, torch.float32, expected), (name, diff)


def _generate(name, saved, live, out, request):
    os.makedirs(out)
    argv = ["--load", saved.save, "--greedy", "--max-new-tokens", str(NEW_TOKENS), "--output-json",
            os.path.join(out, "out.json")]
    assert generate.main(argv + [x for p in PROMPTS for x in ("--prompt", p)]) == 0
    with open(os.path.join(out, "out.json")) as f:
        assert [r["token_ids"] for r in json.load(f)] == live.greedy(name)


def _post(port: int, body: dict) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as reply:
        return json.loads(reply.read())


def _serve(name, saved, live, out, request):
    """tools/serve.py's loading path (its parse_args and load_generator), served on a free port for one request."""
    generator = serve.load_generator(serve.parse_args(["--load", saved.save, "--port", "0"]))
    body = {"prompt": PROMPTS, "max_new_tokens": NEW_TOKENS, "greedy": True}

    async def one_request():
        server = make_server(generator, ServerLimits().validate(), "127.0.0.1", 0)
        await server.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _post, server.port, body)
        finally:
            await server.stop()

    reply = asyncio.run(asyncio.wait_for(one_request(), timeout=120))
    assert [c["token_ids"] for c in reply["completions"]] == live.greedy(name)


READ = {"resume": _resume, "merger": _merger, "ds_to_universal": _universal, "to_hf": _to_hf,
        "generate": _generate, "serve": _serve}


@pytest.mark.multiprocess
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reader_works_or_refuses_before_any_work(trained, live, request, tmp_path, name, reader):
    out = str(tmp_path / "out")
    if (name, reader) in REFUSED:
        error, phrase = REFUSED[name, reader]
        with pytest.raises(error, match=phrase):
            READ[reader](name, trained[name], live, out, request)
        assert not os.path.exists(out), f"{name} x {reader}: refused after writing {os.listdir(out)}"
    else:
        READ[reader](name, trained[name], live, out, request)


@pytest.mark.multiprocess
def test_the_live_runs_learn_and_decode_differently(trained, live):
    """What the matrix compares against is not degenerate: each run's second loss is below its first, and the
    live weights' greedy continuations differ between prompts."""
    for name, saved in trained.items():
        assert saved.losses[2] < saved.losses[1], (name, saved.losses)
        assert len({tuple(ids) for ids in live.greedy(name)}) == len(PROMPTS), (name, live.greedy(name))

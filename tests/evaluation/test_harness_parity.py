"""lm-evaluation-harness through our model class against the harness's own Hugging Face backend, and during
training.

One 4-rank launch trains at TP=2, PP=2 a tiny BLOOM four times (without the harness; with it every 2
iterations, saved; the same stopped after 2 and resumed), a tiny Llama-style model, and BLOOM with the harness at
CP=2, PP=2 and on the model engine (ZeRO-3 and Ulysses, at TP=2), then runs tools/evaluate.py on the BLOOM
checkpoint over the 4 processes (TP=4); to_hf.py exports both models. Then:
- on the local tasks of examples/eval_tasks/ (multiple choice, LAMBADA-style last word, generation) the
  harness's results through ``MegatronLM`` equal its results through ``HFLM`` on the export: every per-sample
  log-likelihood within the tolerance of the tokens it scores (each a log-softmax entry of logits that two
  computations of the model move by at most ``model_tolerance``), perplexities within the sum of those, the same
  greedy flags, accuracy and generated text identical;
- ``loglikelihood_rolling`` on held-out text is exp of our own loss on the same tokens;
- tools/evaluate.py writes the harness's JSON and tensorboard scalars, at TP=1 and TP=4 alike;
- training with --eval-harness-tasks gives bit-identical losses, resumes exactly, and logs the metrics of the
  model it saves (at CP=2 x PP=2 too, and on the model engine: ZeRO-3 x DP=2 x TP=2, Ulysses=2 x TP=2);
- bad task files, unknown tasks and a checkpoint whose tokenizer files are gone are one ValueError each.
Everything runs offline (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1; the export is a local folder).
"""
import json
import math
import os
import shutil

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import model_tolerance, tolerance
from tests.helpers.paths import REPO_ROOT
from tests.helpers.training import tensorboard_scalars, train

TASKS_DIR = str(REPO_ROOT / "examples" / "eval_tasks")
SCORED = ["tiny_choice", "tiny_last_word", "tiny_generate", "tiny_heldout"]
LIVE_TASKS = ["tiny_choice", "tiny_last_word"]
# the corpus metrics: sums of log-likelihoods (perplexities of a task, bits per byte)
PPL = (("tiny_last_word", "perplexity"), ("tiny_heldout", "word_perplexity"), ("tiny_heldout", "bits_per_byte"))
LLAMA = ("--normalization", "rmsnorm", "--swiglu", "--num-key-value-heads", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96")
HARNESS = ("--eval-harness-tasks", ",".join(LIVE_TASKS), "--eval-harness-include-path", TASKS_DIR,
           "--eval-harness-limit", "8")
# the live harness on the model engine (runs of the launch below, at TP=2): name -> flags
MODEL_ENGINE_RUNS = {"ZeRO-3 x DP=2 x TP=2": ("--zero-stage", "3"), "Ulysses=2 x TP=2": ("--ds-sequence-parallel-size", "2")}
TOOL_FLAGS = ["--tasks", "tiny_choice,tiny_last_word", "--include-path", TASKS_DIR, "--batch-size", "4",
              "--no-builtin-tasks"]


@pytest.fixture(scope="module")
def offline():
    """No hub access for the module's tests (the harness and transformers read local files only); one torch
    thread (the tiny models' matrices gain nothing from two, and lose a lot on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.chdir(REPO_ROOT)  # the example tasks' data_files are relative to the repository root
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_corpus, offline):
    """One 4-rank launch: five training runs at TP=2, PP=2, then tools/evaluate.py on the BLOOM checkpoint split
    over the 4 processes (TP=4, as under torchrun). {"bloom" / "llama": (checkpoint, to_hf.py export),
    "tp4_results": that evaluation's results folder, "tensorboard": the BLOOM run's, "records": the runs'
    records (the last rank's): BLOOM without the harness, with it (the "bloom" checkpoint), with it stopped after
    2 iterations, its resume to 4, and Llama}."""
    from tools.convert_checkpoint import to_hf

    root = tmp_path_factory.mktemp("eval_harness")
    common = dict(train_iters=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    # Wide inits (as tests/inference's parity tests) so that the models prefer different words for different
    # contexts instead of one token everywhere.
    bloom = dict(init_method_std=0.3, **common)
    live = ("--eval-harness-interval", "2", *HARNESS)
    runs = [tiny_argv(tiny_corpus, **bloom),
            tiny_argv(tiny_corpus, *live, save=str(root / "bloom"), save_interval=2, tensorboard_dir=str(root / "tb"),
                      **bloom),
            # the same schedule stopped (and saved) after iteration 2, then resumed
            tiny_argv(tiny_corpus, *live, save=str(root / "first"), save_interval=100, exit_interval=2, **bloom),
            tiny_argv(tiny_corpus, *live, load=str(root / "first"), **bloom),
            tiny_argv(tiny_corpus, *LLAMA, save=str(root / "llama"), save_interval=4, init_method_std=0.15,
                      position_embedding_type="rope", embed_layernorm=False, **common),
            # context parallelism: each rank scores its load-balanced tokens, the log-probabilities gathered
            tiny_argv(tiny_corpus, *live, context_parallel_size=2, save=str(root / "bloom cp2"), save_interval=4,
                      tensorboard_dir=str(root / "tb cp2"), init_method_std=0.3, train_iters=4,
                      pipeline_model_parallel_size=2)]
    # the model engine (one stage): ZeRO-3 gathers each module's parameters for the harness's forwards on both
    # data-parallel replicas; under Ulysses each rank scores its contiguous half of the tokens
    runs += [tiny_argv(tiny_corpus, *live, *flags, save=str(root / f"bloom {name}"), save_interval=4,
                       tensorboard_dir=str(root / f"tb {name}"), init_method_std=0.3, train_iters=4,
                       tensor_model_parallel_size=2)
             for name, flags in MODEL_ENGINE_RUNS.items()]
    evaluate_argv = ["--load", str(root / "bloom"), *TOOL_FLAGS, "--output_path", str(root / "tp4_results")]
    results = run_distributed(_train_then_evaluate, world_size=4, args=(runs, evaluate_argv),
                              env={"OMP_NUM_THREADS": "1"}, timeout=600)
    out = {"tp4_results": root / "tp4_results", "tensorboard": root / "tb", "records": results[-1],
           "live": {"TP=2 x PP=2": (root / "bloom", root / "tb"), "CP=2 x PP=2": (root / "bloom cp2", root / "tb cp2"),
                    **{name: (root / f"bloom {name}", root / f"tb {name}") for name in MODEL_ENGINE_RUNS}}}
    for name in ("bloom", "llama"):
        assert to_hf.main(["--load", str(root / name), "--output-dir", str(root / f"{name}_hf")]) == 0
        out[name] = (str(root / name), str(root / f"{name}_hf"))
    return out


def _train_then_evaluate(rank, world_size, runs, evaluate_argv):
    from tools import evaluate

    records = train(rank, world_size, runs)
    assert evaluate.main(evaluate_argv) == 0
    return records


def _results_json(folder) -> dict:
    [path] = [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files]
    with open(path) as f:
        return json.load(f)


def _evaluate(lm, tasks=SCORED):
    from megatron.evaluation import harness

    manager = harness.task_manager(tasks, TASKS_DIR, builtin=False)
    return harness.run_tasks(lm, tasks, manager, harness.HarnessSettings(log_samples=True))


def _largest_logit(model, run):
    """(run(), the largest |logit| ``model`` computed meanwhile)."""
    largest = [0.0]

    def hook(module, inputs, output):
        largest[0] = max(largest[0], output.detach().abs().max().item())

    handle = model.register_forward_hook(hook)
    try:
        return run(), largest[0]
    finally:
        handle.remove()


def _per_token_bound(lm, logit_scale: float) -> float:
    """How far two computations of ``lm``'s model (another backend, TP size or batch) can move the log-probability
    of one scored token: a log-softmax entry is a logit minus the log-sum-exp, each moved by at most the logits'
    tolerance (``model_tolerance``); the log-softmax's own shift, exp, sum over the vocabulary and log add theirs."""
    return (2 * model_tolerance(lm.config, torch.float32, torch.tensor([logit_scale]))
            + tolerance(torch.float32, 4, lm.vocab_size, logit_scale))


def _scored_tokens(lm, arguments) -> int:
    """At most how many tokens a request's log-likelihood sums: every token of (context, continuation), or of a
    rolling request's whole text."""
    return len(lm.tok_encode("".join(arguments[:2] if len(arguments) > 1 else arguments)))


def _log_metric_rtol(lm, per_token: float, samples) -> float:
    """The relative tolerance of a task's corpus metric (perplexity: of its log; bits per byte: itself), a sum of
    the samples' log-likelihoods over a fixed count: the samples' bounds summed, over their log-likelihoods'
    sum."""
    bound = sum(_scored_tokens(lm, s["arguments"][0]) * per_token for s in samples)
    return bound / abs(sum(s["resps"][0][0][0] if isinstance(s["resps"][0][0], (list, tuple)) else s["resps"][0][0]
                           for s in samples))


def _assert_metrics_match(got: dict, expected: dict, rtols: dict, cast=0.0) -> None:
    """{"task/metric": value}: accuracies equal (the same decisions), perplexities and bits per byte within
    ``rtols[task]`` (of the log for perplexities) and ``cast`` (a float32 rounding of the logged value)."""
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for name, value in expected.items():
        task, metric = name.split("/")
        if metric.startswith("acc") or metric == "exact_match":
            assert got[name] == value, (name, got[name], value)
        elif metric.endswith("perplexity"):
            diff = abs(math.log(got[name]) - math.log(value))
            assert diff <= rtols[task] * abs(math.log(value)) + cast, (name, got[name], value)
        else:
            diff = abs(got[name] - value)
            assert diff <= rtols[task] * abs(value) + cast * abs(value), (name, got[name], value)


@pytest.fixture(scope="module")
def both_backends(trained):
    """{model: (results through MegatronLM, results through the harness's HFLM on the export, our MegatronLM,
    the tolerance of one scored token's log-probability)}."""
    from lm_eval.models.huggingface import HFLM

    from megatron.evaluation.harness_model import MegatronLM

    out = {}
    for name in ("bloom", "llama"):
        ckpt, hf_dir = trained[name]
        lm = MegatronLM.from_checkpoint(ckpt, batch_size=4)
        ours, logit_scale = _largest_logit(lm.model, lambda: _evaluate(lm))
        theirs = _evaluate(HFLM(pretrained=hf_dir, batch_size=4, device="cpu", dtype="float32"))
        out[name] = (ours, theirs, lm, _per_token_bound(lm, logit_scale))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["bloom", "llama"])
def test_results_equal_the_harness_hf_backend_on_the_export(both_backends, name):
    ours, theirs, lm, per_token = both_backends[name]
    worst = 0.0
    for task in SCORED:
        mine, reference = ours["samples"][task], theirs["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in reference], task
        assert len(mine) == (8 if task == "tiny_heldout" else 24), task
        for a, b in zip(mine, reference):
            if task == "tiny_generate":
                assert a["resps"] == b["resps"], (task, a["doc_id"], a["resps"], b["resps"])
                continue
            if task == "tiny_heldout":  # a whole text's log-likelihood (about 100 tokens, in several windows)
                [[ll_a]], [[ll_b]] = a["resps"], b["resps"]
                ll_diff, bound = abs(ll_a - ll_b), _scored_tokens(lm, a["arguments"][0]) * per_token
                assert ll_diff <= bound, (task, a["doc_id"], ll_a, ll_b)
                continue
            for [(ll_a, greedy_a)], [(ll_b, greedy_b)], arguments in zip(a["resps"], b["resps"], a["arguments"]):
                worst = max(worst, abs(ll_a - ll_b))
                ll_diff, bound = abs(ll_a - ll_b), _scored_tokens(lm, arguments) * per_token
                assert ll_diff <= bound, (task, a["doc_id"], ll_a, ll_b)
                assert greedy_a == greedy_b, (task, a["doc_id"], ll_a, ll_b)
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in theirs["results"][task]:
                assert ours["results"][task][metric] == theirs["results"][task][metric], (task, metric)
    rtols = {task: _log_metric_rtol(lm, per_token, theirs["samples"][task])
             for task in ("tiny_last_word", "tiny_heldout")}
    _assert_metrics_match({f"{task}/{metric}": ours["results"][task][f"{metric},none"] for task, metric in PPL},
                          {f"{task}/{metric}": theirs["results"][task][f"{metric},none"] for task, metric in PPL},
                          rtols)
    print(f"{name}: largest per-sample log-likelihood difference {worst:.2g}; "
          + ", ".join(f"{t} {k.split(',')[0]} {v:.4g}" for t in SCORED for k, v in ours["results"][t].items()
                      if k.split(",")[0] in ("acc", "acc_norm", "perplexity", "exact_match", "word_perplexity")))
    # The models are trained a little: not one answer everywhere (else equal accuracies would show little).
    assert len({s["resps"][0][0][0] for s in ours["samples"]["tiny_last_word"]}) == 24
    assert len({s["resps"][0][0] for s in ours["samples"]["tiny_generate"] if s["resps"][0][0]}) > 12


@pytest.mark.multiprocess
def test_rolling_loglikelihood_is_exp_of_our_loss(trained):
    """The harness's rolling windows over a held-out text (each token predicted once, the first from the
    end-of-document token) give exp of the loss our model computes (``gpt_loss``) on the same tokens cut into
    training samples, with the embedding's padding rows out of the softmax; with them in (as training counts
    them) the perplexity is higher."""
    from lm_eval.api.instance import Instance

    from megatron.evaluation.harness_model import MegatronLM
    from megatron.model.gpt import gpt_loss

    lm = MegatronLM.from_checkpoint(trained["bloom"][0])
    with open(os.path.join(TASKS_DIR, "data", "tiny_heldout.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    # A text whose token count a window length up to 32 divides: the harness's windows are then exactly the
    # samples [eod, t0 .. t(L-1)], [t(L-1) .. t(2L-1)], ... that training and our evaluation cut.
    text, tokens, length = next((t, ids, n) for t in texts for ids in [lm.tok_encode(t)]
                                for n in range(32, 15, -1) if len(ids) % n == 0)
    lm = MegatronLM(lm.model, lm.tokenizer, lm.config, max_length=length)
    [total], logit_scale = _largest_logit(lm.model, lambda: lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0)]))
    stream = torch.tensor([lm.eot_token_id] + tokens)
    samples = torch.stack([stream[i:i + length + 1] for i in range(0, len(tokens), length)])  # [b, L + 1]
    mask = torch.ones(samples.shape[0], length)  # [b, L]
    with torch.no_grad():
        logits = lm.model(samples[:, :-1])  # [L, b, vp]
        padded = gpt_loss(logits, samples[:, 1:], mask).item()
        logits[..., lm.vocab_size:] = float("-inf")  # the padding rows: no token of the tokenizer
        unpadded = gpt_loss(logits, samples[:, 1:], mask).item()
    harness = math.exp(-total / len(tokens))
    # The same model on windows batched another way: each token's log-probability within _per_token_bound, so
    # their mean too; the mean loss's own sum and division.
    bound = (_per_token_bound(lm, max(logit_scale, logits[..., :lm.vocab_size].abs().max().item()))
             + tolerance(torch.float32, 2, len(tokens), unpadded))
    print(f"perplexity of {len(tokens)} held-out tokens in windows of {length}: harness {harness:.6f}, exp of our "
          f"loss {math.exp(unpadded):.6f} ({math.exp(padded):.6f} with the {logits.shape[-1] - lm.vocab_size} "
          f"padding rows in the softmax)")
    assert abs(-total / len(tokens) - unpadded) <= bound, (harness, math.exp(unpadded))
    assert math.exp(padded) > harness * 1.01


@pytest.mark.multiprocess
def test_the_tool_writes_the_harness_json_and_tensorboard_also_under_torchrun(trained, both_backends, tmp_path):
    from megatron.evaluation.harness import headline_metrics
    from tools import evaluate

    assert evaluate.main(["--load", trained["bloom"][0], *TOOL_FLAGS, "--output_path", str(tmp_path / "out"),
                          "--tensorboard-dir", str(tmp_path / "tb")]) == 0
    results = _results_json(tmp_path / "out")
    ours, _, lm, per_token = both_backends["bloom"]
    expected = headline_metrics({"results": {task: ours["results"][task] for task in ("tiny_choice", "tiny_last_word")}})
    assert set(expected) == {"tiny_choice/acc", "tiny_choice/acc_norm", "tiny_last_word/acc",
                             "tiny_last_word/perplexity"}
    # The tool's own run of the model (another process, other batches): within the perplexity's tolerance.
    rtols = {"tiny_last_word": _log_metric_rtol(lm, per_token, ours["samples"]["tiny_last_word"])}
    _assert_metrics_match(headline_metrics(results), expected, rtols)
    assert results["config"]["model_num_parameters"] > 0 and "tiny_choice" in results["configs"]
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert sorted(scalars) == sorted(f"lm-eval/{name}" for name in expected)
    for name, value in headline_metrics(results).items():
        [(step, logged)] = scalars[f"lm-eval/{name}"]
        assert step == 4, name  # the checkpoint's iteration
        assert logged == torch.tensor(value, dtype=torch.float32).item(), name  # exact: tensorboard holds float32
    # The same under torchrun's environment on 4 processes (the fixture's launch): the model split over TP=4.
    _assert_metrics_match(headline_metrics(_results_json(trained["tp4_results"])), expected, rtols)


def test_the_harness_registry_builds_our_model_from_its_argument_string(trained):
    """What `lm_eval --model megatron --model_args load=CKPT,...` does once megatron.evaluation is imported."""
    from lm_eval.api.registry import get_model

    from megatron.evaluation.harness_model import MegatronLM

    lm = get_model("megatron").create_from_arg_string(f"load={trained['bloom'][0]},batch_size=3,max_length=24")
    assert isinstance(lm, MegatronLM) and (lm.batch_size, lm.max_length, lm.vocab_size) == (3, 24, 400)
    assert lm.eot_token_id == lm.tokenizer.eod and not lm.model.training
    # the harness's generation settings, read as HFLM reads them (lm_eval's normalize_gen_kwargs): do_sample alone
    # samples at temperature 1, a temperature alone samples at it, temperature 0 or do_sample False is greedy
    for gen_kwargs, greedy, temperature in (({"do_sample": True}, False, 1.0), ({"temperature": 0.5}, False, 0.5),
                                            ({"temperature": 0}, True, 1.0), ({"do_sample": False}, True, 1.0)):
        params, max_context = lm._sampling_params({**gen_kwargs, "until": ["."], "max_gen_toks": 8})
        assert (params.greedy, params.temperature, params.stop, max_context) == (greedy, temperature,
                                                                                 (".", "<|endoftext|>"), 16)
    with pytest.raises(ValueError, match=r"max_gen_toks 256 leaves no room for a context in max_length 24"):
        lm._sampling_params({})


@pytest.mark.multiprocess
def test_training_losses_are_bit_identical_with_the_harness_and_after_resume(trained):
    plain, with_harness, first, resumed, *_ = trained["records"]
    assert plain["iterations"] == with_harness["iterations"] == [1, 2, 3, 4]
    assert with_harness["losses"] == plain["losses"] and with_harness["grad_norms"] == plain["grad_norms"]
    assert first["iterations"] == [1, 2] and first["reason"] == "exit-interval" and resumed["iterations"] == [3, 4]
    assert first["losses"] + resumed["losses"] == plain["losses"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["TP=2 x PP=2", "CP=2 x PP=2", *MODEL_ENGINE_RUNS])
def test_the_metrics_logged_during_training_are_the_saved_models(trained, run):
    from megatron.evaluation import harness
    from megatron.evaluation.harness_model import MegatronLM

    checkpoint, tensorboard = trained["live"][run]
    scalars = tensorboard_scalars(tensorboard)
    logged = {tag.removeprefix("lm-eval/"): values for tag, values in scalars.items() if tag.startswith("lm-eval/")}
    assert sorted(logged) == ["tiny_choice/acc", "tiny_choice/acc_norm", "tiny_last_word/acc",
                              "tiny_last_word/perplexity"]
    assert all([step for step, _ in values] == [2, 4] for values in logged.values())
    assert "lm-loss-training/lm loss" in scalars  # beside the loss, in the same event files
    lm = MegatronLM.from_checkpoint(str(checkpoint), batch_size=2)
    results, logit_scale = _largest_logit(lm.model, lambda: harness.score_tasks(
        lm, LIVE_TASKS, harness.task_manager(LIVE_TASKS, TASKS_DIR, builtin=False),
        harness.HarnessSettings(limit=8, log_samples=True)))
    saved = harness.headline_metrics(results)
    assert set(saved) == set(logged)
    # Logged at the run's layout during training, scored here at TP=1 in other batches: the perplexity within its
    # tolerance, and the float32 rounding of the logged value (tensorboard holds float32).
    rtols = {"tiny_last_word": _log_metric_rtol(lm, _per_token_bound(lm, logit_scale),
                                                results["samples"]["tiny_last_word"])}
    _assert_metrics_match({name: [v for step, v in values if step == 4][0] for name, values in logged.items()},
                          saved, rtols, cast=torch.finfo(torch.float32).eps)
    assert logged["tiny_last_word/perplexity"][0][1] != logged["tiny_last_word/perplexity"][1][1]  # it trained


def test_a_malformed_task_file_is_one_clear_error(tmp_path):
    from megatron.evaluation.harness import task_manager

    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_path: json\n  data_files: [unclosed\n")
    with pytest.raises(ValueError, match=r"task file .*broken\.yaml.* cannot be read as a task"):
        task_manager(["broken"], str(tmp_path))
    (tmp_path / "broken.yaml").write_text("task: typo\ndataset_path: json\ndataset_kwargs: {data_files: {test: x}}\n"
                                          "test_split: test\noutput_type: multiple_choise\ndoc_to_text: q\n")
    from megatron.evaluation.harness import run_tasks

    manager = task_manager(["typo"], str(tmp_path), builtin=False)
    with pytest.raises(ValueError, match=r"task\(s\) typo: the harness cannot load them: .*multiple_choise"):
        run_tasks(None, ["typo"], manager)


def test_an_unknown_task_is_one_clear_error():
    from megatron.evaluation.harness import task_manager

    with pytest.raises(ValueError, match=r"unknown task\(s\) tiny_choise under include_path .*known: tiny_choice"):
        task_manager(["tiny_choise"], TASKS_DIR, builtin=False)


@pytest.mark.multiprocess
def test_a_checkpoint_without_its_tokenizer_files_is_one_clear_error(trained, tmp_path):
    from tools import evaluate

    ckpt = shutil.copytree(trained["bloom"][0], tmp_path / "ckpt")
    record = ckpt / (ckpt / "latest").read_text().strip() / "run_state.json"
    state = json.loads(record.read_text())
    state["tokenizer"]["vocab_file"] = str(tmp_path / "gone" / "vocab.json")
    record.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"checkpoint .*: its tokenizer cannot be built .*vocab\.json.* is not a "
                                         r"file.*pass --tokenizer-type and its files"):
        evaluate.main(["--load", str(ckpt), "--tasks", "tiny_choice", "--include_path", TASKS_DIR])


def test_the_training_flags_go_together():
    from megatron.config import PrecisionConfig, TrainingConfig
    from tests.helpers.config import run_config

    with pytest.raises(ValueError, match=r"--eval-harness-tasks tiny_choice and --eval-harness-interval None go "
                                         r"together"):
        TrainingConfig(train_iters=4, eval_harness_tasks=("tiny_choice",)).validate()
    with pytest.raises(ValueError, match=r"--eval-harness-tasks \(none\) and --eval-harness-interval 2"):
        TrainingConfig(train_iters=4, eval_harness_interval=2).validate()
    with pytest.raises(ValueError, match=r"--eval-harness-limit must be > 0"):
        TrainingConfig(train_iters=4, eval_harness_tasks=("a",), eval_harness_interval=2,
                       eval_harness_limit=0).validate()
    live = TrainingConfig(train_iters=10, eval_iters=0, eval_harness_tasks=("tiny_choice",), eval_harness_interval=2)
    assert run_config(training=live).validate().training.eval_harness_interval == 2
    # the model engine's runs too (test_the_metrics_logged_during_training_are_the_saved_models trains them)
    assert run_config(training=live, precision=PrecisionConfig(zero_stage=2)).validate().on_model_engine

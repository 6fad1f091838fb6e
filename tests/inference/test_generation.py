"""Generation: the KV-cache path equals recomputing the sequence, end-of-document stops, sampling rules."""


import pytest
import torch

from megatron.inference.generation import (
    MIN_TEMPERATURE,
    Generator,
    SamplingParams,
    StreamingText,
    generate_token_ids,
    sample_next_token,
    tokenizer_from_record,
)
from megatron.model import GPTModel
from megatron.testing.tolerance import model_tolerance
from tests.helpers.checkpoint import (
    POSITIONS,
    random_state_dict,
    tiny_model_config,
    tokenizer_record,
    write_random_checkpoint,
)


def _model(kind="alibi"):
    config = tiny_model_config(**POSITIONS[kind])
    model = GPTModel(config).eval()
    model.load_state_dict(random_state_dict(config))
    return model


@pytest.mark.parametrize("kind", sorted(POSITIONS))
def test_kv_cache_decoding_equals_recomputing_the_whole_sequence(kind):
    model = _model(kind)
    params = SamplingParams(max_new_tokens=16, greedy=True)
    outputs = set()
    for prompt in ([5], [17, 230, 41, 8], list(range(60, 80))):
        cached, _ = generate_token_ids(model, prompt, params, vocab_size=400, eod=None)
        full, _ = generate_token_ids(model, prompt, params, vocab_size=400, eod=None, use_cache=False)
        assert cached == full, (kind, prompt)
        assert len(cached) == 16
        outputs.add(tuple(cached))
    assert len(outputs) == 3
    # The cached last-step logits equal the full forward's (not just the argmax).
    sequence = [17, 230, 41, 8] + cached[:10]
    caches = model.new_kv_caches()
    with torch.no_grad():
        model(torch.tensor([sequence[:4]]), kv_caches=caches)
        for token in sequence[4:]:
            step = model(torch.tensor([[token]]), kv_caches=caches)  # [1, 1, vp]
        full = model(torch.tensor([sequence]))  # [s, 1, vp]
    # One token's products against the whole sequence's sum in other orders. Measured on AVX-512 and on AVX2,
    # logits up to 9: 4e-6 to 1.1e-5 (the tolerance: 8e-5 to 1e-4, a margin of 7 or more).
    difference = (step[-1] - full[-1]).abs().max().item()
    assert difference <= model_tolerance(model.config, torch.float32, full[-1]), (kind, difference)


def test_generation_stops_at_end_of_document():
    model = _model()
    params = SamplingParams(max_new_tokens=24, greedy=True)
    free, reason = generate_token_ids(model, [17, 230], params, vocab_size=400, eod=None)
    assert reason == "length"
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # a token first produced at step k
    stopped, reason = generate_token_ids(model, [17, 230], params, vocab_size=400, eod=free[k])
    assert (stopped, reason) == (free[:k + 1], "eod")


def test_completion_text_leaves_out_the_end_of_document_token(tiny_corpus):
    model = _model()
    tokenizer = tokenizer_from_record(tokenizer_record(tiny_corpus))
    prompt = "The river"
    free, _ = generate_token_ids(model, tokenizer.tokenize(prompt), SamplingParams(max_new_tokens=8, greedy=True),
                                 vocab_size=400, eod=None)
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])

    class StopsAt:  # the tiny_corpus tokenizer, with a later greedy token as its end-of-document id
        eod = free[k]
        tokenize, detokenize = tokenizer.tokenize, tokenizer.detokenize

    [completion] = Generator(model, StopsAt(), model.config).generate([prompt], SamplingParams(8, greedy=True))
    assert completion.token_ids == free[:k + 1] and completion.finish_reason == "eod"
    assert completion.text == tokenizer.detokenize(free[:k])


def test_sampling_is_reproducible_with_a_seed_and_varies_across_seeds(tiny_corpus):
    model = _model()
    generator = Generator(model, tokenizer_from_record(tokenizer_record(tiny_corpus)), model.config)
    prompts = ["The river", "Model data"]

    def run(**kw):
        return [c.token_ids for c in generator.generate(prompts, SamplingParams(max_new_tokens=16, **kw))]

    for kw in (dict(seed=7), dict(seed=7, top_k=5, temperature=0.7), dict(seed=7, top_p=0.8)):
        first = run(**kw)
        assert run(**kw) == first, kw
        assert run(**dict(kw, seed=8)) != first, kw
        assert all(0 <= t < 400 for ids in first for t in ids)  # padded rows 400..511 are never produced
    greedy = run(greedy=True)
    assert run(seed=3, top_k=1) == greedy
    assert run(seed=3, top_p=1e-6) == greedy


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))  # ranks: 1, 3, 2, 0
    generator = torch.Generator().manual_seed(0)

    def support(**kw):
        params = SamplingParams(max_new_tokens=1, **kw)
        return {sample_next_token(logits, params, generator) for _ in range(400)}

    assert support(top_k=2) == {1, 3}
    assert support(top_p=0.7) == {1, 3}         # 0.5 < 0.7 <= 0.8
    assert support(top_p=0.85) == {1, 3, 2}     # 0.8 < 0.85 <= 0.95
    assert support(top_p=0.5) == {1}
    assert support() == {0, 1, 2, 3}
    counts = torch.bincount(torch.tensor([sample_next_token(logits, SamplingParams(1, top_k=2), generator)
                                          for _ in range(4000)]), minlength=4).float() / 4000
    # renormalized over the kept two: a frequency of 4000 draws, within 4 standard deviations of a binomial share
    share = 0.5 / 0.8
    assert abs(counts[1].item() - share) <= 4 * (share * (1 - share) / 4000) ** 0.5, counts


@pytest.mark.parametrize("fields,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(temperature=0.0), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
    (dict(temperature=1e-300), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=float("nan")), "top_p"),
    (dict(stop=("",)), "stop"), (dict(stop="ab"), "stop")])
def test_invalid_sampling_parameters_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields).validate()


def test_tiny_temperature_and_top_p_are_sane_at_the_edge_of_fp32():
    # logits / 1e-300 overflow to +-inf in fp32 (a NaN softmax): such a temperature is refused; the smallest
    # accepted one behaves as argmax. A top_p of 1e-300 is 0 in fp32: the most likely token still stays.
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    generator = torch.Generator().manual_seed(0)
    for params in (SamplingParams(1, temperature=MIN_TEMPERATURE), SamplingParams(1, top_p=1e-300),
                   SamplingParams(1, top_p=5e-324, temperature=3.0)):
        assert {sample_next_token(logits, params.validate(), generator) for _ in range(50)} == {1}, params


class _Chars:
    """A tokenizer whose ids are characters (id = code point), for exact expectations about text."""
    eod = None

    def tokenize(self, text):
        return [ord(c) for c in text]

    def detokenize(self, ids):
        return "".join(chr(i) for i in ids)


def test_streaming_text_cuts_at_a_stop_string_and_holds_back_what_may_still_change():
    text = StreamingText(_Chars(), stop=("END", "\n\n"))
    pieces = []
    for char in "ab\nc E":
        assert not text.add(ord(char))
        pieces.append(text.take())
    assert pieces == ["a", "b", "", "\nc", " ", ""]  # "\n" and "E" may start a stop string: held back
    assert not text.add(ord("N")) and text.take() == ""
    assert text.add(ord("D")) and text.text == "ab\nc " and text.stopped
    assert text.take() == "" and text.take(final=True) == ""
    # A character whose bytes are not all out decodes to U+FFFD: held back until it is complete.
    text = StreamingText(_Chars())
    text.add(ord("x")), text.add(0xFFFD)
    assert text.take() == "x" and text.take(final=True) == "\ufffd"


def test_stop_strings_and_streamed_text_through_the_generator(tiny_corpus):
    model = _model()
    tokenizer = tokenizer_from_record(tokenizer_record(tiny_corpus))
    generator = Generator(model, tokenizer, model.config)
    prompts = ["The river", "Model data"]
    free = generator.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True))
    pieces = {0: [], 1: []}
    streamed = generator.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True),
                                  on_text=lambda index, piece: pieces[index].append(piece))
    assert [c.to_json() for c in streamed] == [c.to_json() for c in free]
    assert ["".join(pieces[i]) for i in (0, 1)] == [c.text for c in free]
    assert len(pieces[0]) > 1  # given while generating, not in one piece at the end
    # A stop string taken from the middle of the free text: the text ends right before it.
    whole = free[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    [cut] = generator.generate(prompts[:1], SamplingParams(max_new_tokens=12, greedy=True, stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == whole[:whole.index(stop)]
    assert cut.token_ids == free[0].token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 12
    pieces = {0: []}
    generator.generate(prompts[:1], SamplingParams(max_new_tokens=12, greedy=True, stop=(stop,)),
                       on_text=lambda index, piece: pieces[index].append(piece))
    assert "".join(pieces[0]) == cut.text


def test_learned_positions_limit_prompt_plus_new_tokens(tiny_corpus):
    model = _model("absolute")  # 64 positions
    generator = Generator(model, tokenizer_from_record(tokenizer_record(tiny_corpus)), model.config)
    with pytest.raises(ValueError, match="exceeds the model's 64 learned positions"):
        generator.generate(["The river"], SamplingParams(max_new_tokens=63, greedy=True))
    with pytest.raises(ValueError, match="no tokens"):
        generator.generate([""], SamplingParams(max_new_tokens=4, greedy=True))


def test_generator_loads_the_saved_dtype_on_request(tmp_path, tiny_corpus):

    write_random_checkpoint(tmp_path, tiny_corpus, tp=2)
    generator = Generator.from_checkpoint(str(tmp_path), dtype="bf16")
    assert next(generator.model.parameters()).dtype == torch.bfloat16
    [completion] = generator.generate(["The river"], SamplingParams(max_new_tokens=4, greedy=True))
    assert len(completion.token_ids) == 4
    write_random_checkpoint(tmp_path / "bf16", tiny_corpus, params_dtype="bf16")
    saved = Generator.from_checkpoint(str(tmp_path / "bf16"), dtype="saved")
    assert next(saved.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8'"):
        Generator.from_checkpoint(str(tmp_path), dtype="int8")

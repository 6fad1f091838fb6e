"""Request checks without a server: strict JSON, prompt counting that never tokenizes a huge text whole."""

import pytest

from megatron.inference.validation import (
    _PIECE_CHARS,
    RequestError,
    ServerLimits,
    check_prompts,
    load_json_object,
    parse_generate_request,
    tokenize_prompt,
)


class _Words:
    """One token per space-separated word; records how many characters it was asked to tokenize."""

    def __init__(self):
        self.tokenized = 0

    def tokenize(self, text):
        self.tokenized += len(text)
        return [len(word) for word in text.split()]


class _Generator:
    def __init__(self):
        self.tokenizer = _Words()

    def check_length(self, num_prompt_tokens, max_new_tokens):
        if num_prompt_tokens < 1:
            raise ValueError("the prompt has no tokens; give at least one")


@pytest.mark.parametrize("raw,message", [
    (b'{"seed": ' + b"9" * 5000 + b"}", "Exceeds the limit"),  # Python's int-from-string limit (4300 digits)
    (b'{"a": 1e400}', "out of range"), (b'{"a": -1e400}', "out of range"), (b'{"a": NaN}', "NaN"),
    (b"[" * 100_000, "nested too deeply"), (b'"text"', "JSON object"), (b"\xff\xfe", "not valid JSON")])
def test_malformed_json_is_a_400(raw, message):
    with pytest.raises(RequestError, match=message) as error:
        load_json_object(raw)
    assert error.value.status == 400


def test_a_long_prompt_is_counted_in_pieces_and_refused_early():
    limits = ServerLimits(max_prompt_tokens=100)
    generator = _Generator()
    with pytest.raises(RequestError, match="the limit is 100") as error:
        tokenize_prompt(generator, "word " * 200_000, limits, 4)  # 1 MB, 200,000 tokens
    assert error.value.status == 413
    # 200 tokens (twice the limit) fit in one piece of _PIECE_CHARS characters of "word "; the next piece
    # passes them: two pieces at most were tokenized.
    assert generator.tokenizer.tokenized <= 2 * _PIECE_CHARS
    # Just over the limit, or a long text within it: tokenized whole, for the exact count.
    for text, expected in (("word " * 101, 413), ("x" * 3 * _PIECE_CHARS + " y", 2)):
        generator = _Generator()
        try:
            result = len(tokenize_prompt(generator, text, limits, 4))
        except RequestError as refused:
            result = refused.status
        assert result == expected, text[:20]


def test_generate_request_fields():
    prompts, params = parse_generate_request(b'{"prompt": ["a", "b"], "max_new_tokens": 3, "top_p": 0.5, "seed": 2}',
                                             ServerLimits())
    assert prompts == ["a", "b"] and (params.max_new_tokens, params.top_p, params.seed) == (3, 0.5, 2)


def test_nesting_depth_is_counted_before_parsing_whatever_the_recursion_limit():
    import sys

    from megatron.inference.validation import MAX_JSON_DEPTH, RequestError, json_depth, load_json_object

    assert json_depth(b'{"prompt": ["a[[[", "b"], "x": {"y": [1]}}') == 3  # brackets in strings do not count
    assert json_depth(b'"\\"[[[["') == 0
    deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)  # as torch.compile's dynamo does: the parser alone would accept it
    try:
        with pytest.raises(RequestError, match="nested too deeply"):
            load_json_object(deep)
    finally:
        sys.setrecursionlimit(limit)
    assert load_json_object(b'{"prompt": [[1, 2]]}') == {"prompt": [[1, 2]]}


def test_token_id_prompts_only_where_asked_for():
    limits = ServerLimits(max_prompts=3)
    assert check_prompts([1, 2], limits, token_ids=True) == [[1, 2]]
    assert check_prompts([[1], [2, 3]], limits, token_ids=True) == [[1], [2, 3]]
    assert check_prompts(["a", "b"], limits, token_ids=True) == ["a", "b"]
    for prompt, token_ids in (([1, 2], False), (["a", [1]], True), ([], True), ([[1.0]], True), ([[1]] * 4, True)):
        with pytest.raises(RequestError) as error:
            check_prompts(prompt, limits, token_ids=token_ids)
        assert (error.value.status, error.value.param) == (413 if len(prompt) == 4 else 400, "prompt"), prompt

"""OpenAI's API with the real `openai` client on 127.0.0.1: /v1/completions (text and token-id prompts),
/v1/chat/completions (the plain template and a checkpoint tokenizer's own), /v1/models. The text is the
Generator's (and tools/generate.py's on the rendered chat prompt), streamed or not; errors name OpenAI's fields."""

import dataclasses
import http.client
import json
import pathlib
import shutil
import threading

import openai
import pytest

from megatron.inference.generation import Generator, SamplingParams
from megatron.inference.server import ServerLimits
from tests.helpers.checkpoint import write_random_checkpoint
from tests.helpers.server import RunningServer, hold_prefill, request
from tools import generate

LIMITS = ServerLimits(max_prompt_tokens=48, max_new_tokens_limit=16, max_request_bytes=4096, max_prompts=4,
                      default_max_new_tokens=8)


FINISH = {"length": "length", "eod": "stop", "stop": "stop"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The river"}]
PLAIN_PROMPT = "system: Be brief.\nuser: The river\nassistant:"  # docs/serving.md's plain template
# A chat template of the kind tokenizers ship (tokenizer_config.json), refusing a conversation without a system
# message as real ones refuse roles out of order.
TEMPLATE = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}"
            "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEMPLATE_PROMPT = "<|system|>Be brief.\n<|user|>The river\n<|assistant|>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_corpus):
    path = tmp_path_factory.mktemp("openai_ckpt")
    write_random_checkpoint(path, tiny_corpus)
    return path


@pytest.fixture(scope="module")
def generator(checkpoint):
    return Generator.from_checkpoint(str(checkpoint))


@pytest.fixture(scope="module")
def template_tokenizer(tmp_path_factory, tiny_corpus):
    """The tiny corpus's tokenizer as a transformers folder whose tokenizer_config.json carries TEMPLATE."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    shutil.copy(pathlib.Path(tiny_corpus["vocab_file"]).with_name("tokenizer.json"), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def port(generator):
    running = RunningServer(generator, LIMITS, model_name="tiny-bloom")
    yield running.port
    running.close()


@pytest.fixture(scope="module")
def client(port):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-checked", max_retries=0,
                       timeout=60) as client:
        yield client


def _expected(generator, prompts, max_new_tokens, **kwargs):
    return generator.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, greedy=True, **kwargs))


def test_greedy_completions_are_the_generators_text(client, generator):
    [expected] = _expected(generator, ["The river"], 10)
    reply = client.completions.create(model="anything", prompt="The river", max_tokens=10, temperature=0)
    assert reply.object == "text_completion" and reply.model == "tiny-bloom" and reply.id.startswith("cmpl-")
    [choice] = reply.choices
    assert (choice.index, choice.text, choice.logprobs) == (0, expected.text, None)
    assert choice.finish_reason == {"length": "length", "eod": "stop"}[expected.finish_reason]
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_token_ids), len(expected.token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_prompt_lists_and_n_order_the_choices_prompt_by_prompt(client, generator):
    prompts = ["The river", "Model data"]
    expected = _expected(generator, prompts, 6)
    reply = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    assert reply.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)  # each prompt once
    assert reply.usage.completion_tokens == 2 * sum(len(e.token_ids) for e in expected)


def test_streamed_text_adds_up_to_the_generators_text(client, generator):
    prompts = ["The river", "Model data"]
    expected = _expected(generator, prompts, 12)
    chunks = list(client.completions.create(model="m", prompt=prompts, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finished = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert texts == {0: expected[0].text, 1: expected[1].text}
    assert finished == {i: {"length": "length", "eod": "stop"}[e.finish_reason] for i, e in enumerate(expected)}
    assert len(chunks) > 4  # pieces as they were generated, not one chunk per choice
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert len({c.id for c in chunks}) == 1


def test_the_stream_is_server_sent_events_ending_with_done(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": "The river", "max_tokens": 4,
                                                             "temperature": 0, "stream": True}))
    response = conn.getresponse()
    events = response.read().decode().split("\n\n")
    conn.close()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3][len("data: "):])["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_strings_cut_the_text_streamed_or_not(client, generator):
    [free] = _expected(generator, ["The river"], 16)
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    [expected] = _expected(generator, ["The river"], 16, stop=(stop,))
    assert expected.finish_reason == "stop" and expected.text == free.text[:free.text.index(stop)]
    reply = client.completions.create(model="m", prompt="The river", max_tokens=16, temperature=0, stop=[stop, "zzz"])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (expected.text, "stop")
    chunks = list(client.completions.create(model="m", prompt="The river", max_tokens=16, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_is_reproducible(client):
    def texts(seed):
        reply = client.completions.create(model="m", prompt=["The river", "Model"], max_tokens=12, temperature=0.9,
                                          top_p=0.95, seed=seed, n=2)
        return [c.text for c in reply.choices]

    first = texts(5)
    assert texts(5) == first and texts(6) != first


BAD = [
    ("lone surrogate", b'{"model": "m", "prompt": "\\ud800"}', 400, "prompt"),
    ("temperature 1e-300", {"temperature": 1e-300}, 400, "temperature"),
    ("negative temperature", {"temperature": -1}, 400, "temperature"),
    ("NaN top_p", b'{"model": "m", "prompt": "a", "top_p": NaN}', 400, None),
    ("logprobs", {"logprobs": 2}, 400, "logprobs"),
    ("echo", {"echo": True}, 400, "echo"),
    ("best_of 2", {"best_of": 2}, 400, "best_of"),
    ("unknown field", {"beam_width": 2}, 400, "beam_width"),
    ("n 0", {"n": 0}, 400, "n"),
    ("n as bool", {"n": True}, 400, "n"),
    ("five stop strings", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("empty stop string", {"stop": ""}, 400, "stop"),
    ("max_tokens 0", {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens -5", {"max_tokens": -5}, 400, "max_tokens"),
    ("temperature 3", {"temperature": 3}, 400, "temperature"),
    ("top_p 0", {"top_p": 0}, 400, "top_p"),
    ("a token id outside the vocabulary", {"prompt": [1, 400]}, 400, "prompt"),
    ("a negative token id", {"prompt": [[1], [-1]]}, 400, "prompt"),
    ("texts and token ids mixed", {"prompt": ["a", [1]]}, 400, "prompt"),
    ("an empty token-id prompt", {"prompt": [[]]}, 400, "prompt"),
    ("token ids as booleans", {"prompt": [True]}, 400, "prompt"),
    ("token ids over the token limit", {"prompt": [5] * 49}, 413, "prompt"),
    ("no model", b'{"prompt": "a"}', 400, "model"),
    ("stream as string", {"stream": "yes"}, 400, "stream"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("max_tokens over the limit", {"max_tokens": 17}, 413, "max_tokens"),
    ("prompts x n over the limit", {"prompt": ["a", "b"], "n": 3}, 413, "prompt"),
    ("prompt over the token limit", {"prompt": "the river " * 30}, 413, "prompt"),
    ("body over the byte limit", {"prompt": "x" * 5000}, 413, None),
]


BAD_CHAT = [
    ("max_tokens 0", {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens -5", {"max_tokens": -5}, 400, "max_tokens"),
    ("max_completion_tokens 0", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("both max_tokens names", {"max_tokens": 2, "max_completion_tokens": 2}, 400, "max_tokens"),
    ("max_tokens over the limit", {"max_tokens": 17}, 413, "max_tokens"),
    ("max_completion_tokens over the limit", {"max_completion_tokens": 17}, 413, "max_completion_tokens"),
    ("temperature 3", {"temperature": 3}, 400, "temperature"),
    ("temperature 1e-300", {"temperature": 1e-300}, 400, "temperature"),
    ("no messages", {"messages": []}, 400, "messages"),
    ("a tool message", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("content as a number", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("an image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400,
     "messages"),
    ("an unknown message field", {"messages": [{"role": "user", "content": "a", "tool_calls": []}]}, 400,
     "messages"),
    ("lone surrogate", b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages"),
    ("logprobs", {"logprobs": True}, 400, "logprobs"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("unknown field", {"beam_width": 2}, 400, "beam_width"),
    ("n over the limit", {"n": 5}, 413, "n"),
    ("messages over the token limit", {"messages": [{"role": "user", "content": "the river " * 30}]}, 413,
     "messages"),
    ("no model", b'{"messages": [{"role": "user", "content": "a"}]}', 400, "model"),
    ("body over the byte limit", {"messages": [{"role": "user", "content": "x" * 5000}]}, 413, None),
]
CASES = [("/v1/completions", *case) for case in BAD] + [("/v1/chat/completions", *case) for case in BAD_CHAT]


def _create(client, path: str, body: dict):
    if path == "/v1/completions":
        return client.completions.create(model="m", prompt=body.get("prompt", "a"), extra_body=body)
    return client.chat.completions.create(model="m", messages=body.get("messages", MESSAGES), extra_body=body)


@pytest.mark.parametrize("path,name,body,status,param", CASES, ids=[f"{c[0][4:]}: {c[1]}" for c in CASES])
def test_bad_requests_get_openais_error_shape(port, client, path, name, body, status, param):
    base = {"prompt": "a"} if path == "/v1/completions" else {"messages": MESSAGES}
    raw = body if isinstance(body, bytes) else json.dumps({"model": "m", **base, **body}).encode()
    got, reply = request(port, "POST", path, raw=raw)
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"], error
    if not isinstance(body, bytes):  # the openai client raises the matching error, with the same error object
        with pytest.raises(openai.APIStatusError) as raised:
            _create(client, path, body)
        assert raised.value.status_code == status
        assert {k: v for k, v in raised.value.body.items() if k != "message"} == \
            {k: v for k, v in error.items() if k != "message"}
    assert client.completions.create(model="m", prompt="a", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_models_lists_the_served_checkpoint(port, client):
    [model] = client.models.list().data
    assert (model.id, model.object, model.owned_by) == ("tiny-bloom", "model", "megatron-ds3d")
    assert client.models.retrieve("tiny-bloom").id == "tiny-bloom"
    status, reply = request(port, "GET", "/v1/models/other")
    assert status == 404 and reply["error"]["type"] == "invalid_request_error", reply
    assert request(port, "POST", "/v1/models", {})[0] == 405


def test_token_id_prompts_are_answered_as_text_prompts_are(client, generator):
    texts = ["The river", "Model data"]
    expected = _expected(generator, texts, 6)
    ids = [e.prompt_token_ids for e in expected]
    single = client.completions.create(model="m", prompt=ids[0], max_tokens=6, temperature=0)
    assert [c.text for c in single.choices] == [expected[0].text]
    assert single.usage.prompt_tokens == len(ids[0])
    batched = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0, n=2)
    assert [c.text for c in batched.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    # ids that no text tokenizes to (the end-of-document id inside) reach the model as they are
    raw = [5, 0, 17, 300, 2]
    [alone] = generator.generate([""], SamplingParams(max_new_tokens=6, greedy=True), prompt_ids=[raw])
    chunks = list(client.completions.create(model="m", prompt=[raw], max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == alone.text


def _generate_tool(checkpoint, tmp_path, prompt: str, max_new_tokens: int, *flags: str) -> dict:
    """tools/generate.py's greedy answer for one prompt."""
    out = tmp_path / f"generated_{max_new_tokens}.json"
    assert generate.main(["--load", str(checkpoint), "--prompt", prompt, "--greedy", "--max-new-tokens",
                          str(max_new_tokens), "--output-json", str(out), *flags]) == 0
    [result] = json.loads(out.read_text())
    return result


def test_chat_renders_the_plain_template_and_answers_as_generate_py(client, checkpoint, tmp_path):
    expected = _generate_tool(checkpoint, tmp_path, PLAIN_PROMPT, 10)
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, temperature=0, n=2)
    assert reply.object == "chat.completion" and reply.model == "tiny-bloom" and reply.id.startswith("chatcmpl-")
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in reply.choices] == \
        [(i, "assistant", expected["text"], FINISH[expected["finish_reason"]]) for i in range(2)]
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected["prompt_token_ids"]),
                                                             2 * len(expected["token_ids"]))
    # content as text parts, and the newer max_completion_tokens, ask the same
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    short = _generate_tool(checkpoint, tmp_path, PLAIN_PROMPT, 4)
    reply = client.chat.completions.create(model="m", messages=parts, max_completion_tokens=4, temperature=0)
    assert (reply.choices[0].message.content, reply.usage.completion_tokens) == (short["text"], len(short["token_ids"]))


def test_chat_stop_strings_and_seeds(client, checkpoint, tmp_path):
    free = _generate_tool(checkpoint, tmp_path, PLAIN_PROMPT, 16)["text"]
    stop = free[len(free) // 2:len(free) // 2 + 3]
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0, stop=stop)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (free[:free.index(stop)], "stop")

    def texts(seed):
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=2, seed=seed,
                                               n=2)
        return [c.message.content for c in reply.choices]

    first = texts(5)
    assert texts(5) == first and texts(6) != first and first[0] != first[1]


def test_chat_streams_roles_then_pieces_then_finish_reasons(client, checkpoint, tmp_path):
    expected = _generate_tool(checkpoint, tmp_path, PLAIN_PROMPT, 12)
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert [(c.index, c.delta.role, c.delta.content) for c in chunks[0].choices] == [(0, "assistant", ""),
                                                                                    (1, "assistant", "")]
    texts, finished = {0: "", 1: ""}, {}
    for chunk in chunks[1:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert texts == {0: expected["text"], 1: expected["text"]} and len(chunks) > 5
    assert finished == {0: FINISH[expected["finish_reason"]], 1: FINISH[expected["finish_reason"]]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(expected["token_ids"])
    assert chunks[-1].usage.prompt_tokens == len(expected["prompt_token_ids"])


def test_chat_uses_the_checkpoint_tokenizers_chat_template(checkpoint, template_tokenizer, tmp_path):
    flags = ("--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", str(template_tokenizer))
    expected = _generate_tool(checkpoint, tmp_path, TEMPLATE_PROMPT, 10, *flags)
    generator = Generator.from_checkpoint(str(checkpoint), tokenizer_type="PretrainedFromHF",
                                          tokenizer_name_or_path=str(template_tokenizer))
    running = RunningServer(generator, LIMITS)
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="x", max_retries=0,
                           timeout=60) as client:
            reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, temperature=0)
            assert reply.choices[0].message.content == expected["text"]
            assert reply.usage.prompt_tokens == len(expected["prompt_token_ids"])
            chunks = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, temperature=0,
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
            with pytest.raises(openai.BadRequestError, match="a system message must come first") as refused:
                client.chat.completions.create(model="m", messages=MESSAGES[1:], max_tokens=2)
            assert refused.value.body["param"] == "messages"
    finally:
        running.close()


def test_a_full_queue_is_a_503_in_openais_shape(generator, monkeypatch):
    running = RunningServer(generator, dataclasses.replace(LIMITS, max_pending_requests=1))
    release, entered = hold_prefill(monkeypatch)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    results = []
    held = threading.Thread(target=lambda: results.append(request(running.port, "POST", "/v1/chat/completions", body)))
    try:
        held.start()
        assert entered.wait(30)
        for path, fields in (("/v1/chat/completions", body), ("/v1/completions", {"model": "m", "prompt": "a"})):
            status, reply = request(running.port, "POST", path, fields)
            assert status == 503 and reply["error"]["type"] == "server_error", reply
            assert "1 requests are waiting" in reply["error"]["message"]
    finally:
        release.set()
        held.join(60)
        running.close()
    assert results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] == 2

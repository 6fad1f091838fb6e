"""POST /v1/completions with the real `openai` client on 127.0.0.1: the text is the Generator's, streamed or not."""

import json

import openai
import pytest

from megatron.inference.generation import Generator, SamplingParams
from megatron.inference.server import ServerLimits
from tests.helpers.checkpoint import write_random_checkpoint
from tests.helpers.server import RunningServer, request

LIMITS = ServerLimits(max_prompt_tokens=20, max_new_tokens_limit=16, max_request_bytes=4096, max_prompts=4,
                      default_max_new_tokens=8)


@pytest.fixture(scope="module")
def generator(tmp_path_factory, tiny_corpus):
    path = tmp_path_factory.mktemp("openai_ckpt")
    write_random_checkpoint(path, tiny_corpus)
    return Generator.from_checkpoint(str(path))


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
    import http.client

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
    ("token ids as prompt", {"prompt": [1, 2, 3]}, 400, "prompt"),
    ("no model", b'{"prompt": "a"}', 400, "model"),
    ("stream as string", {"stream": "yes"}, 400, "stream"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("max_tokens over the limit", {"max_tokens": 17}, 413, "max_tokens"),
    ("prompts x n over the limit", {"prompt": ["a", "b"], "n": 3}, 413, "prompt"),
    ("prompt over the token limit", {"prompt": "the river " * 30}, 413, "prompt"),
    ("body over the byte limit", {"prompt": "x" * 5000}, 413, None),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openais_error_shape(port, client, name, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps({"model": "m", "prompt": "a", **body}).encode()
    got, reply = request(port, "POST", "/v1/completions", raw=raw)
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"], error
    if not isinstance(body, bytes):  # the openai client raises the matching error, with the same error object
        with pytest.raises(openai.APIStatusError) as raised:
            client.completions.create(model="m", prompt=body.get("prompt", "a"), extra_body=body)
        assert raised.value.status_code == status
        assert {k: v for k, v in raised.value.body.items() if k != "message"} == \
            {k: v for k, v in error.items() if k != "message"}
    assert client.completions.create(model="m", prompt="a", max_tokens=2, temperature=0).usage.completion_tokens == 2

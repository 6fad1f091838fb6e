"""The HTTP server with real requests on 127.0.0.1: good requests, every kind of bad one, and it keeps serving."""

import http.client
import json
import socket
import threading

import pytest

from megatron.inference.generation import Generator, SamplingParams
from megatron.inference.server import ServerLimits
from tests.helpers.checkpoint import write_random_checkpoint
from tests.helpers.server import RunningServer, request, serve_tool

LIMITS = ServerLimits(max_prompt_tokens=20, max_new_tokens_limit=16, max_request_bytes=2048, max_prompts=4,
                      default_max_new_tokens=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_corpus):
    path = tmp_path_factory.mktemp("server_ckpt")
    write_random_checkpoint(path, tiny_corpus, tp=2, pp=1)
    return str(path)


@pytest.fixture(scope="module")
def generator(checkpoint):
    return Generator.from_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def server(generator):
    running = RunningServer(generator, LIMITS)
    yield running, generator
    running.close()


def _request(server, method, path, body=None, raw=None, headers=None):
    return request(server[0].port, method, path, body=body, raw=raw, headers=headers)


def _good(server):
    status, reply = _request(server, "POST", "/generate", {"prompt": "The river", "max_new_tokens": 6, "greedy": True})
    assert status == 200, reply
    return reply["completions"][0]["token_ids"]


def test_good_requests_return_what_the_generator_returns(server):
    _, generator = server
    expected = generator.generate(["The river"], SamplingParams(max_new_tokens=6, greedy=True))[0].to_json()
    status, reply = _request(server, "POST", "/generate", {"prompt": "The river", "max_new_tokens": 6, "greedy": True})
    assert status == 200 and reply["completions"] == [expected]
    body = {"prompt": ["The river", "Model data"], "max_new_tokens": 5, "top_k": 20, "top_p": 0.9,
            "temperature": 0.8, "seed": 11}
    first = _request(server, "POST", "/generate", body)
    assert first[0] == 200 and len(first[1]["completions"]) == 2
    assert _request(server, "POST", "/generate", body) == first  # the seed makes sampling reproducible
    status, health = _request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["vocab_size"] == 400


BAD_REQUESTS = [
    ("malformed JSON", dict(raw=b'{"prompt": "x", '), 400, "not valid JSON"),
    ("not an object", dict(body=["The river"]), 400, "JSON object"),
    ("no prompt", dict(body={"max_new_tokens": 3}), 400, "'prompt' is required"),
    ("prompt of wrong type", dict(body={"prompt": 5}), 400, "'prompt' must be"),
    ("empty prompt list", dict(body={"prompt": []}), 400, "'prompt' must be"),
    ("empty prompt", dict(body={"prompt": ""}), 400, "no tokens"),
    ("negative max_new_tokens", dict(body={"prompt": "a", "max_new_tokens": -1}), 400, "max_new_tokens"),
    ("max_new_tokens as string", dict(body={"prompt": "a", "max_new_tokens": "5"}), 400, "'max_new_tokens' must be int"),
    ("max_new_tokens as bool", dict(body={"prompt": "a", "max_new_tokens": True}), 400, "'max_new_tokens' must be int"),
    ("top_p above 1", dict(body={"prompt": "a", "top_p": 1.5}), 400, "top_p"),
    ("temperature 0", dict(body={"prompt": "a", "temperature": 0}), 400, "temperature"),
    ("greedy as string", dict(body={"prompt": "a", "greedy": "yes"}), 400, "'greedy' must be bool"),
    ("unknown field", dict(body={"prompt": "a", "beam": 4}), 400, "unknown fields"),
    ("prompt over the token limit", dict(body={"prompt": "the river " * 30}), 413, "the limit is 20"),
    ("too many new tokens", dict(body={"prompt": "a", "max_new_tokens": 17}), 413, "limit 16"),
    ("too many prompts", dict(body={"prompt": ["a"] * 5}), 413, "limit is 4"),
    ("body over the byte limit", dict(raw=json.dumps({"prompt": "x" * 5000}).encode()), 413, "limit is 2048"),
    # Each of these was a 500 (issue 11): a lone surrogate cannot be tokenized, and at 1e-300 the fp32
    # logits / temperature overflow to +-inf. The JSON module alone also lets through NaN, Infinity,
    # 1e999 (inf) and deep nesting (a RecursionError); ints of 5000 digits: tests/inference/test_validation.py.
    ("lone surrogate", dict(raw=b'{"prompt": "The \\ud800 river"}'), 400, "not valid Unicode"),
    ("lone surrogate in a list", dict(raw=b'{"prompt": ["a", "\\udfff"]}'), 400, "prompt 1 is not valid Unicode"),
    ("temperature 1e-300", dict(body={"prompt": "a", "temperature": 1e-300}), 400, "temperature must be"),
    ("NaN", dict(raw=b'{"prompt": "a", "temperature": NaN}'), 400, "NaN is not a JSON number"),
    ("Infinity", dict(raw=b'{"prompt": "a", "top_p": Infinity}'), 400, "Infinity is not a JSON number"),
    ("-Infinity", dict(raw=b'{"prompt": "a", "temperature": -Infinity}'), 400, "-Infinity is not a JSON number"),
    ("1e999", dict(raw=b'{"prompt": "a", "temperature": 1e999}'), 400, "out of range"),
    ("deep nesting", dict(raw=b"[" * 1000 + b"]" * 1000), 400, "nested too deeply"),
    ("not UTF-8", dict(raw=b'{"prompt": "\xff"}'), 400, "not valid JSON"),
    ("empty body", dict(raw=b""), 400, "not valid JSON"),
    ("null prompt", dict(body={"prompt": None}), 400, "'prompt' must be"),
    ("prompt list with a number", dict(body={"prompt": ["a", 3]}), 400, "'prompt' must be"),
    ("temperature as string", dict(body={"prompt": "a", "temperature": "hot"}), 400, "'temperature' must be"),
    ("top_k as float", dict(body={"prompt": "a", "top_k": 2.5}), 400, "'top_k' must be int"),
    ("negative top_k", dict(body={"prompt": "a", "top_k": -1}), 400, "top_k"),
    ("seed as list", dict(body={"prompt": "a", "seed": [1]}), 400, "'seed' must be int"),
    ("negative seed", dict(body={"prompt": "a", "seed": -3}), 400, "seed"),
    ("huge max_new_tokens", dict(body={"prompt": "a", "max_new_tokens": 10 ** 30}), 413, "limit 16"),
    ("a prompt far over the token limit", dict(body={"prompt": "word " * 400}), 413, "the limit is 20"),
]


@pytest.mark.parametrize("name,request_kw,status,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_json_errors_and_the_server_keeps_serving(server, name, request_kw, status, message):
    got, reply = _request(server, "POST", "/generate", **request_kw)
    assert got == status, reply
    assert message in reply["error"] and reply["status"] == status
    _good(server)


def test_a_top_p_below_fp32s_range_keeps_the_most_likely_token(server):
    # top_p=1e-300 compares as 0 in fp32; it was a 500 (every token dropped). It now means argmax.
    greedy = _request(server, "POST", "/generate", {"prompt": "The river", "max_new_tokens": 6, "greedy": True})
    tiny = _request(server, "POST", "/generate", {"prompt": "The river", "max_new_tokens": 6, "top_p": 1e-300})
    assert tiny[0] == 200 and tiny[1]["completions"][0]["token_ids"] == greedy[1]["completions"][0]["token_ids"]


def test_wrong_paths_and_methods(server):
    assert _request(server, "GET", "/nowhere")[0] == 404
    assert _request(server, "POST", "/nowhere", {"prompt": "a"})[0] == 404
    assert _request(server, "GET", "/generate")[0] == 405
    assert _request(server, "POST", "/health", {})[0] == 405
    assert _request(server, "DELETE", "/generate")[0] == 405
    # A POST without Content-Length (raw socket: http.client would add one).
    with socket.create_connection(("127.0.0.1", server[0].port), timeout=60) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\n\r\n")
        reply = sock.makefile("rb").readline()
    assert reply.split()[1] == b"411", reply
    _good(server)


def test_a_failure_inside_generation_is_a_500_and_the_server_keeps_serving(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(server[0].server.service.generator.model, "forward", broken)
    status, reply = _request(server, "POST", "/generate", {"prompt": "The river"})
    assert status == 500 and "out of memory (simulated)" in reply["error"]
    monkeypatch.undo()
    _good(server)


def test_concurrent_requests_are_all_answered(server):
    expected = _good(server)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_good(server))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [expected] * 4


def test_serve_tool_runs_as_a_process(checkpoint):
    with serve_tool(checkpoint, "--max-new-tokens-limit", "8", "--read-timeout", "5", "--torch-threads", "1",
                    env={"OMP_NUM_THREADS": "2"}) as (port, _):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/generate", body=json.dumps({"prompt": "The river", "max_new_tokens": 9}))
        response = conn.getresponse()
        assert response.status == 413 and "limit 8" in json.loads(response.read())["error"]
        conn.request("POST", "/generate", body=json.dumps({"prompt": "The river", "max_new_tokens": 4, "greedy": True}))
        response = conn.getresponse()
        assert response.status == 200 and len(json.loads(response.read())["completions"][0]["token_ids"]) == 4
        conn.close()
        health = request(port, "GET", "/health")[1]
        assert health["limits"]["read_timeout"] == 5.0 and health["torch_threads"] == 1

"""docs/serving.md's examples, run as written against tools/serve.py: every curl command, and the openai client."""

import json
import re
import subprocess
import sys

import pytest

from tests.helpers.checkpoint import write_random_checkpoint
from tests.helpers.paths import REPO_ROOT
from tests.helpers.server import request, serve_tool

DOC = (REPO_ROOT / "docs" / "serving.md").read_text()


def _blocks(language: str) -> list[str]:
    section = re.search(r"^## Try it\n(.*?)(?=^## )", DOC, re.S | re.M)
    assert section, "docs/serving.md has no '## Try it' section"
    return re.findall(rf"^```{language}\n(.*?)^```", section.group(1), re.S | re.M)


@pytest.fixture(scope="module")
def port(tmp_path_factory, tiny_corpus):
    path = tmp_path_factory.mktemp("docs_ckpt")
    write_random_checkpoint(path, tiny_corpus)
    with serve_tool(path) as (port, _):
        yield port


def test_the_curl_examples_answer_as_the_doc_says(port):
    [block] = _blocks("bash")
    commands = [line for line in block.splitlines() if line.startswith("curl ")]
    assert len(commands) == 8
    replies = [subprocess.run(["bash", "-c", command], env={"PORT": str(port), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=60, check=True).stdout for command in commands]
    health, greedy, sampled, completion, stream, chat, models, nan = replies
    assert json.loads(health)["status"] == "ok"
    assert len(json.loads(greedy)["completions"][0]["token_ids"]) == 8
    assert len(json.loads(sampled)["completions"]) == 2
    assert json.loads(completion)["choices"][0]["text"] == json.loads(greedy)["completions"][0]["text"]
    events = stream.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and len(events) > 3
    # the chat message through the plain template, answered as that text is by /generate
    status, plain = request(port, "POST", "/generate", {"prompt": "user: The river\nassistant:", "max_new_tokens": 8,
                                                        "greedy": True})
    assert status == 200
    assert json.loads(chat)["choices"][0]["message"] == {"role": "assistant",
                                                         "content": plain["completions"][0]["text"]}
    [model] = json.loads(models)["data"]
    assert model["object"] == "model" and model["id"] == json.loads(completion)["model"]
    assert json.loads(nan) == {"error": "the body is not valid JSON: NaN is not a JSON number", "status": 400}


def test_the_openai_client_example_runs(port):
    [block] = _blocks("python")
    code = block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    assert code != block
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    first, streamed = out.splitlines()
    text, total = first.rsplit(" ", 1)
    assert streamed == text and int(total) > 8

"""Tensor-parallel serving: ``torchrun --nproc_per_node 2 tools/serve.py`` on loopback (gloo) gives the greedy
completions of TP=1 generation alone, for a checkpoint saved at another TP / PP (1, 2)."""

import concurrent.futures

import pytest

from megatron.inference.generation import Generator, SamplingParams
from tests.helpers.checkpoint import POSITIONS, write_random_checkpoint
from tests.helpers.inference import MAX_NEW_TOKENS, TOKEN_PROMPTS
from tests.helpers.server import request, serve_tool


@pytest.mark.multiprocess
def test_two_processes_serve_the_greedy_tokens_of_one(tmp_path, tiny_corpus):
    write_random_checkpoint(tmp_path, tiny_corpus, tp=1, pp=2, **POSITIONS["rotary"])
    generator = Generator.from_checkpoint(str(tmp_path))
    prompts = [generator.tokenizer.detokenize(ids) for ids in TOKEN_PROMPTS[:8]]
    expected = [generator.generate([text], SamplingParams(n, greedy=True))[0].to_json()
                for text, n in zip(prompts, MAX_NEW_TOKENS)]
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    with serve_tool(tmp_path, "--max-batch-size", "4", launcher=launcher, env={"OMP_NUM_THREADS": "1"}) as (port, _):
        status, health = request(port, "GET", "/health")
        assert status == 200 and health["tensor_model_parallel_size"] == 2, health

        def ask(i):
            body = {"prompt": prompts[i], "max_new_tokens": MAX_NEW_TOKENS[i], "greedy": True}
            return request(port, "POST", "/generate", body)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 at once into 4 slots: rows join mid-batch
            replies = list(pool.map(ask, range(8)))
    assert [status for status, _ in replies] == [200] * 8
    assert [reply["completions"][0] for _, reply in replies] == expected

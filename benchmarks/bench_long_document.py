"""Peak memory of ``tools/preprocess_data.py`` on ONE very long document, against tokenizing it whole.

A single-line jsonl document of ``--mb`` MB (default 50) is made from the default corpus's texts
joined by spaces. Each side runs in its own process; its peak resident memory is the kernel's
(``os.wait4``), so it includes the interpreter and the libraries:

- ``ours``: the whole tool (read, json parse, tokenize, write .bin/.idx). GPT-2-style byte-level
  BPE tokenizes a long text in pieces cut before spaces (``AbstractTokenizer.tokenize_long``);
- ``whole``: the same tokenizer called once on the whole text (what the tool did before), its ids
  saved, then compared with the dataset the tool wrote (``identical``).

Prints ONE JSON line; ``--output`` also writes it to a file (dated results in ``benchmarks/results/``).

    python -m benchmarks.bench_long_document --output benchmarks/results/long_document_2026-12-01.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks._common import REPO, emit, machine
from megatron.data.corpus import prepare_default_corpus
from megatron.data.indexed_dataset import MMapIndexedDataset

_WHOLE = """
import sys, numpy as np
from megatron.data.tokenizers import GPT2BPETokenizer
import json
text = json.loads(open(sys.argv[1], "rb").read())["text"]
ids = GPT2BPETokenizer(sys.argv[2], sys.argv[3]).tokenize(text)
np.save(sys.argv[4], np.asarray(ids, dtype=np.int64))
"""


def long_document(corpus_jsonl: str, path: str, mb: float) -> int:
    with open(corpus_jsonl) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    target, parts, size = int(mb * 1e6), [], 0
    while size < target:
        for text in texts:
            parts.append(text)
            size += len(text) + 1
            if size >= target:
                break
    with open(path, "w") as f:
        f.write(json.dumps({"text": " ".join(parts)}) + "\n")
    return os.path.getsize(path)


def run_measured(argv: list) -> dict:
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} failed: {output.decode()[-2000:]}")
    return {"seconds": round(time.perf_counter() - started, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50.0, help="size of the document in MB")
    parser.add_argument("--corpus-dir", default="data_cache/default_corpus")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    corpus = prepare_default_corpus(os.path.join(REPO, args.corpus_dir))
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "long.jsonl")
        input_bytes = long_document(corpus["jsonl"], jsonl, args.mb)
        prefix = os.path.join(tmp, "out")
        ours = run_measured([sys.executable, "tools/preprocess_data.py", "--input", jsonl, "--output-prefix", prefix,
                             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", corpus["vocab_file"],
                             "--merge-file", corpus["merge_file"], "--log-interval", "0"])
        whole_ids = os.path.join(tmp, "whole.npy")
        whole = run_measured([sys.executable, "-c", _WHOLE, jsonl, corpus["vocab_file"], corpus["merge_file"],
                              whole_ids])
        written = MMapIndexedDataset(f"{prefix}_text_document")
        identical = len(written) == 1 and np.array_equal(np.asarray(written[0], dtype=np.int64), np.load(whole_ids))
        tokens = int(written.sizes[0])
    for side in (ours, whole):
        side["peak_rss_over_input"] = round(side["peak_rss_mb"] * 2**20 / input_bytes, 2)
    emit({"benchmark": "long_document", "config": {"mb": args.mb, "tokenizer": "GPT2BPETokenizer (default corpus)"},
          "input_bytes": input_bytes, "tokens": tokens, "ours": ours, "whole": whole, "identical": bool(identical),
          "machine": machine()}, args.output)


if __name__ == "__main__":
    main()

"""The README's "Five-minute tour", run as written in a fresh `git clone` of this repository.

The fenced ```bash blocks of the section are run in order, in one bash session (as a reader pasting
them into one terminal), with `set -euo pipefail`. The README's commands use
`PY=${PY:-.venv/bin/python}`; the clone's `.venv` is a symlink to the virtual environment running this
test. The C++ data helpers are built in the clone with `setup.py build_ext --inplace`, the step `make`
runs on a fresh clone (`make` itself is not run: it would reinstall the packages into the shared
environment, whose stamp is older than the clone's setup.py). What the tour must leave behind is
checked on the files: a trained tiny model, its tensorboard record, an exported transformers model and
generated text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO_ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def tour_blocks(readme: str) -> list[str]:
    match = re.search(r"^## Five-minute tour\n(.*?)(?=^## )", readme, re.S | re.M)
    assert match, "README.md has no '## Five-minute tour' section"
    return re.findall(r"^```bash\n(.*?)^```", match.group(1), re.S | re.M)


def test_readme_tour_runs_as_written_in_a_fresh_clone(tmp_path):
    blocks = tour_blocks((REPO_ROOT / "README.md").read_text())
    assert len(blocks) == 2, f"expected the tour's 2 bash blocks, found {len(blocks)}"
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tour's commands run .venv/bin/python; run the tests from a virtual environment (make test)")
    os.symlink(sys.prefix, clone / ".venv")  # this test's own environment (make's .venv under `make test`)
    python = str(clone / ".venv" / "bin" / "python")
    subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=clone, check=True, timeout=300,
                   capture_output=True)

    env = {k: v for k, v in os.environ.items() if k not in ("PY", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(blocks)], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the tour failed ({proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    tour = clone / "runs" / "tour"
    checkpoints = tour / "train" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step100"
    assert (checkpoints / "global_step100" / "complete").is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tour / "train" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    losses = acc.Scalars("lm-loss-training/lm loss")
    assert losses and losses[-1].step == 100
    assert losses[-1].value < losses[0].value, [(e.step, e.value) for e in losses]

    hf = tour / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "bloom" and config["n_layer"] == 2
    assert (hf / "model.safetensors").is_file() and (hf / "tokenizer.json").is_file()

    generated = json.loads((tour / "generated.json").read_text())
    assert [g["prompt"] for g in generated] == ["The model"]
    assert len(generated[0]["token_ids"]) == 20 or generated[0]["finish_reason"] == "eod"
    assert isinstance(generated[0]["text"], str)

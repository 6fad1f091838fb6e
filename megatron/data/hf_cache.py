"""``--tokenizer-name-or-path``: a local path, or a hub name found in the LOCAL Hugging Face cache.

BLOOM ran with ``--tokenizer-name-or-path bigscience-catalogue-data-dev/test-tok``, TRANSFORMERS_OFFLINE=1
and a cache filled beforehand. A name that is not a local path is looked up in that cache the way
huggingface_hub lays it out (``models--ORG--NAME/refs/main`` holds a commit hash,
``snapshots/HASH/`` the files); nothing is ever downloaded: ``snapshot_download(...,
local_files_only=True)`` returns the snapshot folder or raises before any network call. Both the
argument check (``megatron.arguments``) and the tokenizer builder (``megatron.data.tokenizers``)
call ``resolve_tokenizer_path``.

The cache folder is read from the environment at each call, as huggingface_hub reads it at import:
$HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE (its older name), else $HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.
"""

from __future__ import annotations

import os

REVISION = "main"


def hub_cache_dir() -> str:
    """The Hugging Face hub cache folder this process's environment names."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.path.expandvars(os.environ[name]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub")


def resolve_tokenizer_path(name_or_path) -> str:
    """An existing local path, as given; else the cached snapshot folder of the hub repository it names.

    Raises ValueError naming the name, the cache folder searched, the variables that choose it and
    the fix, when it is neither a local path nor cached.
    """
    if os.path.exists(name_or_path):
        return os.fspath(name_or_path)
    name = os.fspath(name_or_path)
    cache = hub_cache_dir()
    # About 0.2 s to import, and needed only for a hub name; huggingface_hub comes with tokenizers and transformers.
    from huggingface_hub import snapshot_download  # noqa: PLC0415 (only when a hub tokenizer name is given)
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError  # noqa: PLC0415 (only when a hub tokenizer name is given)

    try:
        return snapshot_download(name, cache_dir=cache, revision=REVISION, local_files_only=True)
    except HFValidationError:
        raise ValueError(f"--tokenizer-name-or-path {name!r}: no such file or directory, and not a hub name "
                         "(ORG/NAME) either; pass the path of a tokenizer.json or of a directory holding one"
                         ) from None
    except LocalEntryNotFoundError as error:  # also an incomplete snapshot (IncompleteSnapshotError)
        folder = os.path.join(cache, "models--" + name.replace("/", "--"))
        env = ", ".join(f"{var}={os.environ[var]!r}" if os.environ.get(var) else f"{var} unset"
                        for var in ("HF_HUB_CACHE", "HF_HOME"))
        raise ValueError(
            f"--tokenizer-name-or-path {name!r} is not a local path and not in the local Hugging Face cache: "
            f"{folder} has no complete snapshot of revision {REVISION!r} ({type(error).__name__}). The cache "
            f"folder searched is {cache} ({env}; the folder is $HF_HUB_CACHE, else $HF_HOME/hub, else "
            f"~/.cache/huggingface/hub). Nothing is downloaded here: download it once where the hub is "
            f"reachable, into that cache (`HF_HUB_CACHE={cache} hf download {name}`; `huggingface-cli "
            f"download {name}` with older huggingface_hub), or pass a local path (a tokenizer.json or a "
            f"directory holding one)") from None

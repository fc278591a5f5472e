"""Where a model's files are: a directory as given, or a Hugging Face Hub id found in the local cache.

A Hub id resolves offline only: compute nodes often have no internet, and a server job must not
start a 60 GB download. The cache is huggingface_hub's own layout (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``; ``models--ORG--NAME/snapshots/<commit>/``,
``refs/<branch>``), read with huggingface_hub's helpers; the snapshot's commit is the revision the
endpoint file records. Fill the cache on a machine with internet (a login node) with the command
the error names.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path


class ModelNotFound(ValueError):
    """Neither a directory nor a Hub id in the local cache; the message says how to fetch it."""


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str  # what --model said
    path: Path  # the directory vLLM loads (a snapshot for a Hub id)
    revision: str | None  # the snapshot's commit hash; None for a plain directory


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--revision``, as `agent serve` and `agent plan` both take them."""
    parser.add_argument(
        "--model",
        help="model directory, or Hugging Face Hub id resolved offline in the local cache"
        " (HF_HOME / HF_HUB_CACHE)",
    )
    parser.add_argument(
        "--revision", default="main", help="Hub revision (branch, tag or commit) of a Hub id"
    )


def hub_cache() -> Path:
    """The Hub cache of this environment, read now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1


def resolve(model: str, revision: str = "main") -> ResolvedModel:
    """``model`` as a directory (with a config.json), else as a Hub id in the local cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"--model {model}: the directory has no config.json")
        return ResolvedModel(model, path.resolve(), None)
    if _looks_like_path(model):
        raise ModelNotFound(f"--model {model}: no such directory")
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise ModelNotFound(
            f"--model {model}: not a directory, and huggingface_hub (installed with vLLM) is"
            " missing to look it up as a Hub id"
        ) from None
    cache = hub_cache()
    try:
        found = try_to_load_from_cache(model, "config.json", cache_dir=cache, revision=revision)
    except HFValidationError as exc:
        raise ModelNotFound(f"--model {model}: not a directory and not a Hub id ({exc})") from None
    if not isinstance(found, str):  # None, or the cache's "known to be absent" marker
        home = os.environ.get("HF_HOME", str(cache.parent))
        raise ModelNotFound(
            f"model {model} (revision {revision}) is not in the Hugging Face cache {cache}"
            f" (no config.json there); nothing is downloaded at serve time. Fetch it on a machine"
            f" with internet: HF_HOME={home} hf download {model} --revision {revision}"
        )
    snapshot = Path(found).parent
    return ResolvedModel(model, snapshot, snapshot.name)

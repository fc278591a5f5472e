"""The fetch_model rule: fill the Hugging Face cache with server.model at server.revision.

Runs where there is internet (a localrule: the login node). The cache is huggingface_hub's own
layout (HF_HOME/hub/models--ORG--NAME/snapshots/COMMIT/, refs/REVISION), which `agent serve
--model ORG/NAME --revision REVISION` reads offline on the compute nodes. The output records the
snapshot's commit and folder, so the run says which weights it served.
"""

# No `from __future__` here: Snakemake's script directive puts its preamble before this line.
import contextlib
import json
import os
import sys
from pathlib import Path


def fetch(model: str, revision: str, hf_home: str, marker: Path) -> None:
    if os.path.isdir(model):
        raise SystemExit(
            f"fetch_model: server.model {model!r} is a folder, which has nothing to fetch "
            "(expected a Hugging Face Hub id such as Qwen/Qwen3.6-27B)"
        )
    if hf_home:
        os.environ["HF_HOME"] = hf_home
    os.environ.pop("HF_HUB_OFFLINE", None)  # this job is the one asked to download
    from huggingface_hub import constants, snapshot_download  # reads HF_HOME on import

    print(f"fetching {model} at {revision} into {constants.HF_HUB_CACHE}", file=sys.stderr)
    path = Path(snapshot_download(model, revision=revision))
    record = {
        "model": model,
        "revision": revision,
        "commit": path.name,  # the snapshot folder is named by the commit it holds
        "path": str(path),
        "hf_home": constants.HF_HOME,
    }
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(record, indent=2) + "\n")
    print(f"fetched {model} at {revision} (commit {path.name}) into {path}", file=sys.stderr)


if "snakemake" in globals():  # run by the rule; importable without it
    sm = snakemake  # noqa: F821 (given by Snakemake's script directive)
    with open(sm.log[0], "w") as log, contextlib.redirect_stderr(log):
        fetch(sm.params.model, sm.params.revision, sm.params.hf_home, Path(sm.output[0]))

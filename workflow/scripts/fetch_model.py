"""The fetch_model rule: fill the Hugging Face cache with server.model at server.revision.

Runs where there is internet (a localrule: the login node). The cache is huggingface_hub's own
layout (HF_HOME/hub/models--ORG--NAME/snapshots/COMMIT/, refs/REVISION), which `agent serve
--model ORG/NAME --revision REVISION` reads offline on the compute nodes. The checkpoints the model
catalogue names for it come too, at their main revision: its publisher's FP8 checkpoint (served
instead on GPUs with FP8 tensor cores, which this login node cannot know, so both are fetched) and
its drafter for speculative decoding. The output records each snapshot's commit and folder, so the
run says which weights it served.
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

    def one(repo: str, rev: str) -> dict:
        print(f"fetching {repo} at {rev} into {constants.HF_HUB_CACHE}", file=sys.stderr)
        path = Path(snapshot_download(repo, revision=rev))
        # the snapshot folder is named by the commit it holds
        return {"model": repo, "revision": rev, "commit": path.name, "path": str(path)}

    def optional(repo: str) -> dict:
        """A companion that cannot be fetched (gone, gated) leaves the model served without it;
        the launcher says so where it would have chosen it."""
        try:
            return one(repo, "main")
        except OSError as exc:  # huggingface_hub's HTTP and repository errors are OSErrors
            print(f"fetch_model: {repo} not fetched: {exc}", file=sys.stderr)
            return {"model": repo, "error": str(exc)[:300]}

    record = {
        **one(model, revision),
        "hf_home": constants.HF_HOME,
        "companions": [optional(repo) for repo in companions(model)],
    }
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(record, indent=2) + "\n")
    for r in [record, *record["companions"]]:
        if "commit" in r:
            print(
                f"fetched {r['model']} at {r['revision']} (commit {r['commit']})", file=sys.stderr
            )


def companions(model: str) -> list[str]:
    """The checkpoints the model catalogue names for ``model`` (its published FP8 checkpoint, its
    drafter), in the packaged catalogue and $SCAGENT_MODELS."""
    from agent.serve import catalogue

    named = []
    for family in catalogue.load().families.values():
        named += [family.fp8_checkpoints.get(model), family.drafters.get(model)]
    return [repo for repo in named if repo]


if "snakemake" in globals():  # run by the rule; importable without it
    sm = snakemake  # noqa: F821 (given by Snakemake's script directive)
    with open(sm.log[0], "w") as log, contextlib.redirect_stderr(log):
        fetch(sm.params.model, sm.params.revision, sm.params.hf_home, Path(sm.output[0]))

"""The real Snakefile run in a scratch working directory, and a stand-in model server for it.

`workflow_dir` gives a folder with the repository's config (demo defaults) and helpers to write a
sample sheet, override config keys and call `snakemake -s <repo>/Snakefile -d <folder>`, so tests
never touch the repository's own results/, data/, logs/ or .snakemake/.

Run as a script, this file is a stand-in for `python -m agent serve` (the serve_vllm rule's
`server.command`): an OpenAI-compatible server that answers each sample's agent with the tool
calls a recorded run of that sample made, and writes the endpoint file as the real launcher does
(only once it answers, atomically, key in a 0600 file beside it). It lets the workflow's server
group run on a CPU-only cluster in seconds; the real vLLM launcher is tested in tests/test_serve_*.

`StandinHub` serves one model repository over the Hub's HTTP API, for the fetch_model rule's real
download (huggingface_hub pointed at it with HF_ENDPOINT): the machine has no internet.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Nested dict update: a dict value merges into the base's dict, anything else replaces it."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@dataclass
class WorkflowDir:
    """A scratch working directory for the repository's Snakefile."""

    path: Path
    config: dict[str, Any] = field(default_factory=dict)

    def write_sheet(self, rows: list[dict[str, Any]], name: str = "samples.tsv") -> Path:
        """Write rows as a TSV (columns in first-seen order; a missing key is an empty cell)."""
        columns = list(dict.fromkeys(key for row in rows for key in row))
        sheet = self.path / name
        with sheet.open("w", newline="") as handle:
            writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
            writer.writerow(columns)
            writer.writerows([row.get(c, "") for c in columns] for row in rows)
        self.configure(samples=name)
        return sheet

    def configure(self, **overrides: Any) -> None:
        self.config = merge(self.config, overrides)
        (self.path / "config.yaml").write_text(yaml.safe_dump(self.config, sort_keys=False))

    def command(self, *args: str) -> list[str]:
        """The argv of `snakemake` on the repository's Snakefile, run here."""
        return [
            *(sys.executable, "-m", "snakemake"),
            *("-s", str(REPO / "Snakefile"), "-d", str(self.path)),
            *("--configfile", str(self.path / "config.yaml")),
            *args,
        ]

    def snakemake(
        self, *args: str, timeout: float = 600, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run snakemake on the repository's Snakefile here; stdout and stderr together."""
        return subprocess.run(
            self.command(*args),
            cwd=self.path,
            env=workflow_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )


def workflow_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for rules: this interpreter's bin first, so `python -m agent` resolves."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **(extra or {})}


def make_workflow_dir(path: Path) -> WorkflowDir:
    """A working directory holding a copy of config/config.yaml and config/samples.tsv."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    wd = WorkflowDir(path, config)
    (path / "samples.tsv").write_text((REPO / "config" / "samples.tsv").read_text())
    wd.configure(samples="samples.tsv")
    return wd


@pytest.fixture
def workflow_dir(tmp_path: Path) -> WorkflowDir:
    return make_workflow_dir(tmp_path)


DEMO_SAMPLES = ("pbmc1", "pbmc2", "pbmc3", "pbmc4", "pbmc5", "pbmc6")


def check_cohort_outputs(path: Path, samples: tuple[str, ...] = DEMO_SAMPLES) -> None:
    """Every artifact of a finished cohort run exists and says the analysis finished."""
    for sample in samples:
        folder = path / "results" / "samples" / sample
        state = json.loads((folder / "world_state.json").read_text())
        assert state["meta"]["status"] == "finished", (sample, state["meta"])
        assert state["meta"]["sample"] == sample
        assert state["entries"][-1]["tool"] == "finish"
        assert (folder / "adata.h5ad").stat().st_size > 0
        assert (folder / "metrics.jsonl").read_text().strip()
        assert json.loads((folder / "replay.json").read_text())
        for rule in ("demo_data", "analyze", "replay"):
            assert (path / "logs" / rule / f"{sample}.log").is_file(), (rule, sample)
    assert (path / "results" / "cohort" / "composition" / "composition.json").is_file()
    report = path / "results" / "report"
    assert (report / "index.html").stat().st_size > 0
    assert len((report / "cohort.tsv").read_text().splitlines()) == len(samples) + 1


# ---- a stand-in Hugging Face Hub (the fetch_model rule's downloads) ----


class StandinHub:
    """The few Hub API routes `huggingface_hub.snapshot_download` uses, over real HTTP (point
    HF_ENDPOINT at ``url``): one repository at one commit, its files given as bytes."""

    def __init__(self, repo: str, files: dict[str, bytes], commit: str = "c0ffee" + "0" * 34):
        import hashlib
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.repo, self.files, self.commit = repo, files, commit
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(200)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                api = f"/api/models/{hub.repo}/"
                if self.path.startswith(api + "tree/"):  # the commit's files
                    listing = [
                        {"type": "file", "path": name, "size": len(data),
                         "oid": hashlib.sha1(data).hexdigest()}
                        for name, data in hub.files.items()
                    ]  # fmt: skip
                    return self._reply(json.dumps(listing).encode(), {})
                if self.path.startswith(api + "revision/"):  # a branch -> its commit
                    siblings = [{"rfilename": name} for name in hub.files]
                    info = {"id": hub.repo, "sha": hub.commit, "siblings": siblings}
                    return self._reply(json.dumps(info).encode(), {})
                prefix = f"/{hub.repo}/resolve/{hub.commit}/"
                name = self.path[len(prefix) :] if self.path.startswith(prefix) else None
                if name in hub.files:
                    data = hub.files[name]
                    etag = f'"{hashlib.sha1(data).hexdigest()}"'
                    return self._reply(data, {"X-Repo-Commit": hub.commit, "ETag": etag})
                self.send_response(404)
                self.end_headers()

            do_HEAD = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---- the stand-in server (run as a script by the serve_vllm rule) ----


def recorded_calls(folder: Path) -> dict[str, list[dict[str, str]]]:
    """{sample: [{"tool", "arguments"}, ...]} from the world states of a recorded cohort run."""
    from agent.record.world_state import WorldState

    calls = {}
    for path in sorted(folder.glob("*/world_state.json")):
        world = WorldState.load(path)
        calls[world.meta["sample"]] = [
            {"tool": e.tool, "arguments": json.dumps(e.params)} for e in world.entries
        ]
    if not calls:
        raise SystemExit(f"stand-in server: no */world_state.json under {folder}")
    return calls


def serve_standin(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))  # run as a script: make `tests` and `agent` importable
    from agent.testing.scripted_server import ScriptedServer

    parser = argparse.ArgumentParser(description="stand-in for `python -m agent serve`")
    parser.add_argument("--recorded", type=Path, required=True, help="results/samples of a run")
    parser.add_argument("--endpoint-file", type=Path, required=True)
    parser.add_argument("--agents", type=int, default=1)
    parser.add_argument("--model", required=True)  # named in the endpoint, as the launcher does
    parser.add_argument("--revision", default="main")
    args, ignored = parser.parse_known_args(argv)  # --model, --gpus, ... as the real launcher
    started = time.time()
    calls = recorded_calls(args.recorded)

    class RecordedServer(ScriptedServer):
        """Answers each sample's agent (named in its first user message) with its next call."""

        def __init__(self) -> None:
            super().__init__(max_model_len=32768)
            self.lock = threading.Lock()

        def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            first_user = next(m["content"] for m in body["messages"] if m["role"] == "user")
            match = re.search(r"Analyse sample (.+?) from ", first_user)
            queue = calls.get(match.group(1), []) if match else []
            with self.lock:  # agents of a shard ask concurrently; the script slot is shared
                self.script = [queue.pop(0)] if queue else []
                return super().answer(body)

    server = RecordedServer()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    key_file = args.endpoint_file.with_suffix(".key")
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.write_text(secrets.token_hex(16))
    key_file.chmod(0o600)
    endpoint = {
        "url": server.base_url,
        "model": "scripted",
        "api_key_file": str(key_file.resolve()),
        "max_model_len": server.max_model_len,
        "flags": [],
        "vllm_version": "stand-in (tests/fixtures_workflow.py)",
        "model_id": args.model,
        "revision": args.revision,
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", "none"),
        "timings": {"ready_s": round(time.time() - started, 3)},
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "agents": args.agents,
        "ignored_options": ignored,
    }
    tmp = args.endpoint_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(endpoint, indent=2))
    os.replace(tmp, args.endpoint_file)
    slurm_job = os.environ.get("SLURM_JOB_ID", "none")
    print(f"stand-in server ready at {server.base_url} in slurm job {slurm_job}", flush=True)
    while not stop.wait(1):  # a timed wait: the SIGTERM handler runs between waits
        pass
    served = len(server.requests)
    server.close()
    print(f"stand-in server stopped by SIGTERM after {served} requests", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(serve_standin(sys.argv[1:]))

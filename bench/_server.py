"""One vLLM server for a benchmark, started through ``python -m agent serve`` and always stopped.

The model is the tiny random-weight Qwen3-style model of agent/testing/tiny_model.py unless a model
directory is given: its text is noise, but token counts, prefix caching and prefill costs are the
server's real ones. Its tokenizer is trained on a synthetic corpus of the agent's own words and
compresses the prompts far better than a real model's; ``broad_model`` builds the same model with a
byte-level BPE of a real model's vocabulary size trained on a broad corpus that ships on the
machine (``BROAD_CORPUS``), whose compression of the prompts is close to a real model's. The
server runs with ``VLLM_SERVER_DEV_MODE=1`` so that a benchmark can empty the prefix cache between
arms (``POST /reset_prefix_cache``) and compare them from the same start.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from agent.endpoint import Endpoint, http_json, read_endpoint, root_url
from agent.policies.llm import LLMPolicy
from agent.serve import metrics as server_metrics
from agent.testing.local_server import (
    ServerFailed,
    launch,
    stop_launcher,
    wait_for_endpoint,
)

SERVED_NAME = "bench-model"
STOP_TIMEOUT_S = 90.0


@dataclass
class Server:
    endpoint: Endpoint
    launcher: subprocess.Popen
    startup_s: float

    @property
    def base_url(self) -> str:
        return self.endpoint.url

    @property
    def api_key(self) -> str:
        return self.endpoint.api_key or "EMPTY"

    def policy(self, max_tokens: int = 8) -> LLMPolicy:
        """The agent's LLM policy for this server, every reply exactly ``max_tokens`` long (the
        random model stops at random; a fixed length keeps the decode work of arms equal)."""
        return LLMPolicy(
            self.base_url,
            self.endpoint.model,
            self.api_key,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )

    def warm_up(self, tools: list[dict]) -> None:
        """One request with the agent's tools, before anything is measured: first-use costs (the
        tool-call grammar, lazy initialisation) must not land in the first arm's figures. Its
        prompt shares no prefix with an agent's (no system message), so it warms no cache."""
        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key)
        client.chat.completions.create(
            model=self.endpoint.model,
            messages=[{"role": "user", "content": "Warm up: call any tool."}],
            tools=tools,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    def metrics(self) -> dict[str, Any]:
        """The server's watched Prometheus series (``agent.serve.metrics.parse``)."""
        return server_metrics.scrape(self.base_url, self.api_key)

    def reset_prefix_cache(self) -> None:
        status, body = http_json(
            "POST", root_url(self.base_url) + "/reset_prefix_cache", self.api_key
        )
        if status != 200:
            raise ServerFailed(f"/reset_prefix_cache answered {status}: {str(body)[:200]}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server options every serving benchmark shares."""
    parser.add_argument(
        "--model", help="model directory (default: the tiny test model, built here)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="context length (default: the KV plan's, the model's full context here)",
    )
    parser.add_argument(
        "--serve-args",
        default="--enforce-eager",
        help="more arguments for `python -m agent serve` (default: %(default)s: on CPU,"
        " torch.compile adds minutes of start-up and did not speed up the tiny model)",
    )


def serve_from_args(
    args: argparse.Namespace, workdir: Path, agents: int = 4, built: Path | None = None
):
    """The server the options ask for; ``built``: a random-weight model built here, served
    unless --model names another."""
    return serve(
        workdir,
        args.model or built,
        random_weights=args.model is None,
        max_model_len=args.max_model_len,
        agents=agents,
        serve_args=tuple(shlex.split(args.serve_args)),
    )


def tiny_model(workdir: Path) -> Path:
    return _built(workdir / "tiny-qwen3")


def _built(target: Path, **build: Any) -> Path:
    """The tiny model in ``target``, built there first (``build``: build_tiny_model's options)
    unless an earlier run did."""
    from transformers.utils import logging as hf_logging

    from agent.testing.tiny_model import build_tiny_model

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in a benchmark's output
    return target if (target / "config.json").exists() else build_tiny_model(target, **build)


# (what, folder, file pattern): text and JSON that Debian and PyPI packages install here
BROAD_CORPUS = (
    (
        "Python standard library sources (Debian libpython3.11-stdlib)",
        "/usr/lib/python3.11",
        "*.py",
    ),
    (
        "package documentation (/usr/share/doc: READMEs, changelogs, licences)",
        "/usr/share/doc",
        "*",
    ),
    ("JSON files of the environment's packages (schemas, configs)", sys.prefix, "*.json"),
)
CORPUS_BYTES = 12 << 20  # of each source: the BPE's merges settle well before this
BROAD_VOCAB = 32768  # as Llama 2 / Mistral; Qwen's and Llama 3's are larger (compress better)


def broad_corpus(per_source: int = CORPUS_BYTES) -> Iterator[str]:
    """The texts of BROAD_CORPUS in a fixed order, up to ``per_source`` bytes of each (gzipped
    files read whole, files that are not UTF-8 text skipped)."""
    for _what, folder, pattern in BROAD_CORPUS:
        left = per_source
        for path in sorted(Path(folder).rglob(pattern)):
            if left <= 0:
                break
            if not path.is_file() or path.is_symlink():
                continue
            try:
                data = path.read_bytes()
                text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode()
            except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
                continue
            left -= len(text)
            yield text


def broad_model(workdir: Path, vocab_size: int = BROAD_VOCAB) -> Path:
    """The tiny model's Qwen3 build with a ``vocab_size`` byte-level BPE trained on broad_corpus
    (read only when it is built)."""
    return _built(
        workdir / f"tiny-qwen3-broad{vocab_size}", vocab_size=vocab_size, texts=broad_corpus()
    )


@contextlib.contextmanager
def serve(
    workdir: Path,
    model: str | Path | None = None,
    *,
    max_model_len: int | None = 32768,
    agents: int = 4,
    serve_args: tuple[str, ...] = (),
    timeout_s: float = 900.0,
    random_weights: bool | None = None,
) -> Iterator[Server]:
    """Start ``python -m agent serve`` (cpu unless ``serve_args`` say otherwise); stop it on exit.

    A random-weight model (the tiny one when ``model`` is None) is served without a reasoning
    parser: its noise never closes a thinking block, so the parser would take every reply for
    thinking, and the agent's policy would double its completion budget after each one."""
    random_weights = model is None if random_weights is None else random_weights
    model = Path(model) if model else tiny_model(workdir)
    args = [
        *("--model", str(model), "--served-model-name", SERVED_NAME),
        *("--agents", str(agents), "--timeout", str(timeout_s)),
        *(("--max-model-len", str(max_model_len)) if max_model_len else ()),
        *(() if "--gpu" in serve_args else ("--gpu", "cpu")),
        *(("--override", "reasoning_parser=none") if random_weights else ()),
        *serve_args,
    ]
    # SIGTERM (a batch system's stop) must also run the `finally` below, which stops the server
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    start = time.monotonic()
    # the KV cache space on CPU stays the launcher's choice (or the caller's VLLM_CPU_KVCACHE_SPACE)
    launcher, endpoint_file = launch(workdir, *args, env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        wait_for_endpoint(launcher, endpoint_file, timeout_s + 30)
        yield Server(read_endpoint(endpoint_file), launcher, time.monotonic() - start)
    finally:
        stop_launcher(launcher, STOP_TIMEOUT_S)
        signal.signal(signal.SIGTERM, previous)

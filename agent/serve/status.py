"""``python -m agent serve status|metrics --endpoint FILE``: ask a running shard's server how it is.

``status``: up or not (``/health``), the model, its flags, and the headline figures; ``metrics``:
every figure (``--json``: the figures and the raw series as one JSON object). The rates over time
(generation tokens per second) are measured since the launcher's last row in the shard's metrics
file, when there is one. Exit 0 when the server is up, 1 when it is down or has not answered
whole within DEADLINE_S, 2 when the endpoint file is missing or unreadable. ``/health`` and
``/metrics`` need no API key.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent import say
from agent.endpoint import EndpointError, probe, read_info
from agent.record.durable import read_appended_rows
from agent.serve import metrics

ACTIONS = {
    "status": "is a running server up: model, flags and headline figures",
    "metrics": "a running server's figures: prefix cache, MTP acceptance, latencies, load",
}
# (figure, words, format) in the order shown; rates as percentages, seconds in ms
SHOWN = (
    ("requests", "requests finished", "{:.0f}"),
    ("prefix_cache_hit_rate", "prefix-cache hit rate", "{:.1%}"),
    ("spec_acceptance_rate", "MTP acceptance rate", "{:.1%}"),
    ("mean_accepted_length", "mean accepted length", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50", "{:.3f} s"),
    ("ttft_mean_s", "TTFT mean", "{:.3f} s"),
    ("queue_mean_s", "queue time mean", "{:.3f} s"),
    ("e2e_mean_s", "request latency mean", "{:.3f} s"),
    ("decode_tokens_per_s", "decode tokens/s per request", "{:.1f}"),
    ("generation_tokens_per_s", "generated tokens/s (since the last sample)", "{:.1f}"),
    ("running", "requests running", "{:.0f}"),
    ("waiting", "requests waiting", "{:.0f}"),
    ("kv_cache_usage", "KV-cache usage", "{:.1%}"),
    ("preemptions", "preemptions", "{:.0f}"),
)
# the whole of the server's answers: each read's own timeout never ends a server that trickles
DEADLINE_S = 30.0
HEADLINE = (
    "prefix_cache_hit_rate",
    "spec_acceptance_rate",
    "mean_accepted_length",
    "ttft_p50_s",
    "decode_tokens_per_s",
    "running",
    "waiting",
    "kv_cache_usage",
    "preemptions",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint", type=Path, required=True, help="the server's endpoint file (SHARD.json)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")


def live(info: dict[str, Any], endpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(series now, figures): rates since the launcher's last row of the same server."""
    now = metrics.scrape(info["url"])
    rows = []
    if (path := metrics.metrics_path(endpoint)).is_file():
        rows = [r for r in read_appended_rows(path) if r.get("started") == info.get("started_at")]
    if rows and (seconds := time.time() - rows[-1]["time"]) > 0:
        rates = metrics.figures(metrics.difference(now, rows[-1]), seconds)
        shown = {
            **metrics.figures(now),
            "generation_tokens_per_s": rates["generation_tokens_per_s"],
        }
    else:
        shown = metrics.figures(now)
    return now, shown


def ask(info: dict[str, Any], endpoint: Path) -> tuple[str | None, dict, dict]:
    """(what is wrong or None, series, figures) of the server ``info`` names."""
    problem = probe(info["url"])
    if problem is not None:
        return problem, {}, {}
    try:
        return None, *live(info, endpoint)
    except OSError as exc:
        return f"/metrics: {exc}", {}, {}


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, or TimeoutError when it has not returned after ``seconds``; it goes on in a
    daemon thread, which the command's exit ends."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            done["error"] = exc

    thread = threading.Thread(target=run, name="serve-status", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError
    if "error" in done:
        raise done["error"]
    return done["value"]


def lines(figures: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    out = []
    for key, words, form in SHOWN:
        if key in keys:
            value = figures.get(key)
            out.append(f"  {words}: {form.format(value) if value is not None else 'not measured'}")
    return out


def main(args: argparse.Namespace) -> int:
    try:
        info = read_info(args.endpoint, required=(("url", str),))  # all it asks
    except EndpointError as exc:
        say.error(str(exc))
        return 2
    try:
        problem, series, figures = within(DEADLINE_S, lambda: ask(info, args.endpoint))
    except TimeoutError:
        problem = f"no whole answer within {DEADLINE_S:.0f} s"
    if problem is not None:
        say.error(f"down: {info['url']} ({problem}); {args.endpoint} names it")
        return 1
    if args.json:
        doc = {"up": True, "url": info["url"], "model": info.get("model"), "figures": figures}
        doc |= {"flags": info.get("flags")} if args.action == "status" else {"series": series}
        print(json.dumps(doc, indent=1))
        return 0
    print(f"up: {info['url']}")
    if args.action == "status":
        print(f"model: {info.get('model')} ({info.get('model_id') or info.get('model_path')})")
        print(f"vLLM: {info.get('vllm_version')}, ready since {info.get('ready_at')}")
        flags = [f for f in info.get("flags") or [] if f.get("chosen") and not f.get("env")]
        print("flags: " + " ".join(_flag(f) for f in flags))
    print("\n".join(lines(figures, HEADLINE if args.action == "status" else tuple(figures))))
    return 0


def _flag(flag: dict[str, Any]) -> str:
    value = flag.get("value")
    return str(flag.get("name")) + ("" if value is None else f"={value}")

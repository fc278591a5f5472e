"""A vLLM server's Prometheus ``/metrics``: read (``scrape``), kept per shard (``Sampler``: one JSON
line per interval into SHARD.metrics.jsonl beside the endpoint file, and one at shutdown) and
turned into the figures people read (``figures``): prefix-cache hit rate, MTP acceptance, TTFT...

The exposition is parsed with prometheus_client's parser (a vLLM dependency). Each series is
summed over its label sets (one per engine and served name); counters are kept as totals since the
server started, histograms as sum, count and cumulative buckets (enough for a quantile), gauges as
their value. A file holds the rows of every server that ran for its shard, in every workflow run
(rows are appended; a retried job starts a new server): ``started`` tells them apart, as each new
server's counters start from zero. It is the endpoint file's ``started_at``, which the record of
each agent the server served keeps (``meta.server.started_at``), so a reader can take the rows of
the servers its records used (agent/report/performance.py).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from agent import say
from agent.endpoint import http_json, root_url

PREFIX = "vllm:"
SUFFIX = ".metrics.jsonl"  # SHARD.metrics.jsonl beside SHARD.json, the endpoint file
DEFAULT_INTERVAL_S = 15.0
SCRAPE_TIMEOUT_S = 5.0
# The names in vLLM 0.32 (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py), without
# the prefix; an absent one (no speculative decoding, an older vLLM) is not measured.
COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
)
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"  # a counter per draft position
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def metrics_path(endpoint_file: Path) -> Path:
    """Where the launcher of ``endpoint_file`` keeps its server's figures."""
    return endpoint_file.with_suffix(SUFFIX)


def shard_of(path: Path) -> str:
    return path.name.removesuffix(SUFFIX)


def parse(text: str) -> dict[str, Any]:
    """The watched series of one exposition, by name without the ``vllm:`` prefix."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix(PREFIX)
        if not family.name.startswith(PREFIX):
            continue
        if name in COUNTERS:
            out[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif name == PER_POSITION:
            by_position: dict[int, float] = defaultdict(float)
            for s in family.samples:
                if s.name.endswith("_total"):
                    by_position[int(s.labels["position"])] += s.value
            out[name] = [by_position[k] for k in sorted(by_position)]
        elif name in HISTOGRAMS:
            out[name] = _histogram(family.samples)
        elif name in GAUGES:
            values = [s.value for s in family.samples]
            # a share is averaged over engines, a count of requests summed
            out[name] = sum(values) / len(values) if name.endswith("_perc") else sum(values)
    return out


def _histogram(samples: list[Any]) -> dict[str, Any]:
    buckets: dict[str, float] = defaultdict(float)
    total = count = 0.0
    for s in samples:
        if s.name.endswith("_bucket"):
            buckets[s.labels["le"]] += s.value
        elif s.name.endswith("_sum"):
            total += s.value
        elif s.name.endswith("_count"):
            count += s.value
    ordered = sorted(buckets.items(), key=lambda kv: float(kv[0]))
    return {"sum": total, "count": count, "buckets": dict(ordered)}


def scrape(base_url: str, api_key: str | None = None) -> dict[str, Any]:
    """The server's watched series now; OSError when it does not answer."""
    status, body = http_json(
        "GET", root_url(base_url) + "/metrics", api_key, None, SCRAPE_TIMEOUT_S
    )
    if status != 200 or not isinstance(body, str):
        raise OSError(f"/metrics answered {status}")
    return parse(body)


def quantile(histogram: dict[str, Any] | None, q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram, interpolated within its bucket as
    Prometheus' histogram_quantile does; the last finite bound when it lies beyond it."""
    if not histogram or not histogram.get("count"):
        return None
    rank = q * histogram["count"]
    lower, below = 0.0, 0.0
    for le, cumulative in sorted((float(k), v) for k, v in histogram["buckets"].items()):
        if cumulative >= rank:
            if math.isinf(le):
                return lower
            if cumulative == below:
                return le
            return lower + (le - lower) * (rank - below) / (cumulative - below)
        lower, below = le, cumulative
    return lower


def difference(later: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """What happened between two rows of one server: counters and histograms subtracted,
    gauges as they were at the later one."""
    out: dict[str, Any] = {}
    for name, value in later.items():
        before = earlier.get(name)
        if name in COUNTERS and isinstance(before, int | float):
            out[name] = value - before
        elif name == PER_POSITION and isinstance(before, list) and len(before) == len(value):
            out[name] = [a - b for a, b in zip(value, before, strict=True)]
        elif name in HISTOGRAMS and isinstance(before, dict):
            buckets = before.get("buckets", {})
            out[name] = {
                "sum": value["sum"] - before["sum"],
                "count": value["count"] - before["count"],
                "buckets": {k: v - buckets.get(k, 0.0) for k, v in value["buckets"].items()},
            }
        elif name in GAUGES or name in ("time", "started"):
            out[name] = value
    return out


def total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The counters and histograms of all servers in ``rows`` (each server's last row, added);
    gauges of the last row."""
    last = {row.get("started"): row for row in rows}
    out: dict[str, Any] = {}
    for row in last.values():
        for name, value in row.items():
            if name in COUNTERS:
                out[name] = out.get(name, 0.0) + value
            elif name == PER_POSITION:
                mine = out.setdefault(name, [0.0] * len(value))
                out[name] = [a + b for a, b in zip(mine, value, strict=False)]
            elif name in HISTOGRAMS:
                mine = out.setdefault(name, {"sum": 0.0, "count": 0.0, "buckets": {}})
                mine["sum"] += value["sum"]
                mine["count"] += value["count"]
                for k, v in value["buckets"].items():
                    mine["buckets"][k] = mine["buckets"].get(k, 0.0) + v
    if rows:
        out.update({name: rows[-1][name] for name in GAUGES if name in rows[-1]})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mean(histogram: dict[str, Any] | None) -> float | None:
    return _ratio(histogram["sum"], histogram["count"]) if histogram else None


def figures(m: dict[str, Any], seconds: float | None = None) -> dict[str, Any]:
    """The headline figures of totals (or of a ``difference`` over ``seconds``); None where the
    server did not measure it (no speculative decoding, no request yet)."""
    drafts = m.get("spec_decode_num_drafts")
    itl = m.get("inter_token_latency_seconds")
    return {
        "requests": m.get("request_success"),
        "prefix_cache_hit_rate": _ratio(m.get("prefix_cache_hits"), m.get("prefix_cache_queries")),
        "spec_acceptance_rate": _ratio(
            m.get("spec_decode_num_accepted_tokens"), m.get("spec_decode_num_draft_tokens")
        ),
        # vLLM's own definition: the bonus token plus the accepted drafts, per draft
        "mean_accepted_length": (
            1 + m["spec_decode_num_accepted_tokens"] / drafts
            if drafts and m.get("spec_decode_num_accepted_tokens") is not None
            else None
        ),
        "acceptance_per_position": (
            [p / drafts for p in m.get(PER_POSITION) or []] if drafts else None
        ),
        "ttft_p50_s": quantile(m.get("time_to_first_token_seconds"), 0.5),
        "ttft_mean_s": _mean(m.get("time_to_first_token_seconds")),
        "queue_mean_s": _mean(m.get("request_queue_time_seconds")),
        "e2e_mean_s": _mean(m.get("e2e_request_latency_seconds")),
        "inter_token_mean_s": _mean(itl),
        # one request's decode speed: tokens per second between its tokens
        "decode_tokens_per_s": _ratio(itl["count"], itl["sum"]) if itl else None,
        # the server's: all requests' generated tokens over the wall time
        "generation_tokens_per_s": _ratio(m.get("generation_tokens"), seconds),
        "preemptions": m.get("num_preemptions"),
        "running": m.get("num_requests_running"),
        "waiting": m.get("num_requests_waiting"),
        "kv_cache_usage": m.get("kv_cache_usage_perc"),
    }


def servers(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows of each server (by its ``started``), in the order the servers first wrote."""
    by_server: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if isinstance(row.get("started"), str):  # a row of no known server is no server's
            by_server.setdefault(row["started"], []).append(row)
    return by_server


def start_time(started: str) -> float:
    """A server's ``started`` (ISO 8601, as the launcher writes it) in seconds since the epoch,
    the clock of the rows' and the agents' ``time``."""
    return dt.datetime.fromisoformat(started).timestamp()


class Sampler:
    """Appends a row (``time``, the server's ``started``, the watched series) to ``path`` at
    start, every ``interval_s`` while the server lives, and at ``close``; a failed scrape is
    left out (one line on stderr), as the server may be busy or going away."""

    def __init__(
        self,
        base_url: str,
        path: Path,
        interval_s: float,
        started: str,
        api_key: str | None = None,
    ):
        self.base_url, self.path, self.interval_s = base_url, path, interval_s
        self.started, self.api_key = started, api_key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def sample(self) -> bool:
        try:
            series = scrape(self.base_url, self.api_key)
        except OSError as exc:
            say.note(f"metrics not sampled: {exc}")
            return False
        row = {"time": round(time.time(), 3), "started": self.started, **series}
        with open(self.path, "a") as f:  # appended, as a sample's metrics rows are
            f.write(json.dumps(row) + "\n")
        return True

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def close(self) -> None:
        """The last row, while the server still answers."""
        self.stop()
        self.sample()

"""The report's performance section: did the four vLLM layers deliver on this run?

Per shard, from the server's own figures that its launcher sampled into SHARD.metrics.jsonl
(agent/serve/metrics.py): prefix-cache hit rate, MTP acceptance rate and mean accepted length,
TTFT, decode speed, queueing, preemptions and KV usage, with their course over the run. The file
keeps every run's servers; only those that served the records shown count (``servers_used``), so
a rerun that kept an analysis shows the server that made it, and one that kept all of them shows
those servers, as the samples' figures below come from the same requests. Per
sample, from its metrics.jsonl (one row per iteration, agent/loop.py): seconds per iteration, TTFT
of the first step (cold) and of the later ones (warm), the prompt share the cache served after
the first step, decode tokens per second and thinking tokens per step. A key a row lacks (older
records, a policy without a server) is not measured, never zero. ``verdicts`` says in plain words
which layer underdelivers.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.record.collect import Sample
from agent.record.durable import read_appended_rows
from agent.serve import metrics

# Below these the layer is said to underdeliver
HIT_RATE_FLOOR = 0.5  # prompt share served by the prefix cache after warm-up
ACCEPTANCE_FLOOR = 0.5  # MTP drafts accepted
QUEUE_CEILING_S = 1.0  # mean time a request waited for a slot
ITERATION_TARGET_S = 3.0  # the project's aim: an iteration in 1-3 s
MIN_REQUESTS = 5  # a server's rates are judged only over more requests than a start's few
NO_SERVER = "no model server in this run"
SERVED = "each shard's figures are those of the servers that served the records shown"


@dataclass
class Shard:
    name: str
    path: Path
    rows: list[dict[str, Any]]
    figures: dict[str, Any]  # metrics.figures over the whole run
    warm_hit_rate: float | None  # after each server's first sampled interval with requests
    servers: int  # how many servers' rows (a retried server, or a kept analysis's earlier one)
    # per interval, "minutes" in; a row of only "minutes" between two servers
    series: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SampleFigures:
    name: str
    steps: int
    iteration_p50_s: float | None
    iteration_p95_s: float | None
    ttft_cold_s: float | None  # the first step's
    ttft_warm_s: float | None  # median of the later steps'
    queue_p50_s: float | None
    warm_hit_rate: float | None  # cached / prompt tokens, steps after the first
    decode_tokens_per_s: float | None  # median over steps: tokens after the 1st / decode s
    thinking_tokens_per_step: float | None
    thinking_budget_hits: int | None


@dataclass
class Performance:
    shards: list[Shard]
    samples: list[SampleFigures]
    verdicts: list[str]

    @property
    def empty(self) -> bool:
        return not self.shards and not self.samples


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def load_shard(path: Path, rows: list[dict[str, Any]]) -> Shard:
    # the seconds its servers ran, not the gaps between them (a retry, or another workflow run's)
    span = sum(s[-1]["time"] - s[0]["time"] for s in metrics.servers(rows).values()) or None
    return Shard(
        metrics.shard_of(path),
        path,
        rows,
        metrics.figures(metrics.total(rows), span),
        _warm_hit_rate(rows),
        len(metrics.servers(rows)),
        _series(rows),
    )


def servers_used(
    samples: list[Sample], files: dict[str, list[dict[str, Any]]]
) -> set[tuple[str, str]]:
    """(shard, started) of each server that served a step of ``samples``, the runs that asked a
    model: the server a record names (``meta.server.started_at``) and, for each of its steps, the
    newest server of the same shard started before the step (a run resumed on a retried server
    made its earlier steps on the server before). A record that names no server found in
    ``files`` (one made before records named it) counts as served by the newest server of each
    shard no record names."""
    starts = {
        shard: sorted((metrics.start_time(started), started) for started in metrics.servers(rows))
        for shard, rows in files.items()
    }
    home = {started: shard for shard, servers in starts.items() for _, started in servers}
    used: set[tuple[str, str]] = set()
    unnamed = False
    for sample in samples:
        server = sample.meta.get("server")
        named = server.get("started_at") if isinstance(server, dict) else None
        if named not in home:
            unnamed = True
            continue
        shard = home[named]
        used.add((shard, named))
        times = [at for at, _ in starts[shard]]
        for row in sample.metrics:
            if (t := _number(row.get("time"))) is not None and (k := bisect.bisect(times, t)):
                used.add((shard, starts[shard][k - 1][1]))
    if unnamed:
        named_shards = {shard for shard, _ in used}
        used |= {(s, servers[-1][1]) for s, servers in starts.items() if s not in named_shards}
    return used


def _warm_hit_rate(rows: list[dict[str, Any]]) -> float | None:
    """Hits over queries after each server's first interval with traffic (its agents' cold
    first requests, whose system prompt and tools no cache holds yet)."""
    hits = queries = 0.0
    for server in metrics.servers(rows).values():
        busy = [r for r in server if r.get("prefix_cache_queries")]
        if len(busy) > 1:
            hits += busy[-1].get("prefix_cache_hits", 0.0) - busy[0].get("prefix_cache_hits", 0.0)
            queries += busy[-1]["prefix_cache_queries"] - busy[0]["prefix_cache_queries"]
    return hits / queries if queries else None


def _series(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not rows:
        return []
    start = rows[0]["time"]
    out = []
    for k, server in enumerate(metrics.servers(rows).values()):
        if k:  # a restart: no line from one server's figures to the next one's
            out.append({"minutes": (server[0]["time"] - start) / 60})
        for earlier, later in itertools.pairwise(server):
            seconds = later["time"] - earlier["time"]
            if seconds > 0:
                figures = metrics.figures(metrics.difference(later, earlier), seconds)
                out.append({"minutes": (later["time"] - start) / 60, **figures})
    return out


def sample_figures(sample: Sample) -> SampleFigures | None:
    """None for a sample that asked no model (reference or replay policy)."""
    rows = [r for r in sample.metrics if _number(r.get("prompt_tokens")) is not None]
    if not rows:
        return None

    def values(key: str, among: list[dict[str, Any]] = rows) -> list[float]:
        return [v for r in among if (v := _number(r.get(key))) is not None]

    seconds = [
        (_number(r.get("decide_seconds")) or 0.0) + (_number(r.get("tool_seconds")) or 0.0)
        for r in rows
    ]
    later = rows[1:]
    prompt = sum(values("prompt_tokens", later))
    # decode_seconds runs from the first token to the last: the tokens after the first (as
    # vLLM's inter-token latency, which the shard table's decode speed is measured from)
    decode = [
        (c - 1) / d
        for r in rows
        if (c := _number(r.get("completion_tokens")) or 0) > 1
        and (d := _number(r.get("decode_seconds")))
    ]
    hits = [
        r["thinking_budget_hit"] for r in rows if isinstance(r.get("thinking_budget_hit"), bool)
    ]
    thinking = values("reasoning_tokens")
    return SampleFigures(
        name=sample.name,
        steps=len(rows),
        iteration_p50_s=_percentile(seconds, 50),
        iteration_p95_s=_percentile(seconds, 95),
        ttft_cold_s=_number(rows[0].get("ttft_seconds")),
        ttft_warm_s=_median(values("ttft_seconds", later)),
        queue_p50_s=_median(values("queue_seconds")),
        warm_hit_rate=sum(values("cached_tokens", later)) / prompt if prompt else None,
        decode_tokens_per_s=_median(decode),
        thinking_tokens_per_step=statistics.mean(thinking) if thinking else None,
        thinking_budget_hits=sum(hits) if hits else None,
    )


def verdicts(shards: list[Shard], samples: list[SampleFigures]) -> list[str]:
    """Plain words for each layer that did not deliver; empty when all did (or nothing ran)."""
    out = []
    for s in shards:
        f = s.figures
        judged = (f["requests"] or 0) >= MIN_REQUESTS
        hit = s.warm_hit_rate if s.warm_hit_rate is not None else f["prefix_cache_hit_rate"]
        if judged and hit is not None and hit < HIT_RATE_FLOOR:
            out.append(
                f"{s.name}: the prefix cache served only {hit:.0%} of the prompt tokens after "
                f"warm-up (expected most: each step's prompt extends the last). Check that "
                f"prefix caching is on (agent serve status), that no preemptions evict the "
                f"cache (fewer agents per server) and that the prompt does not change between "
                f"steps (the figure of the cached-token ratio per iteration)."
            )
        rate = f["spec_acceptance_rate"]
        if judged and rate is not None and rate < ACCEPTANCE_FLOOR:
            out.append(
                f"{s.name}: MTP drafts were accepted {rate:.0%} of the time (mean accepted "
                f"length {f['mean_accepted_length']:.2f}); below {ACCEPTANCE_FLOOR:.0%} "
                f"speculative decoding costs more than it saves: draft fewer tokens "
                f"(--override num_speculative_tokens=1) or turn it off (--override "
                f"speculative=off)."
            )
        if f["preemptions"]:
            out.append(
                f"{s.name}: {f['preemptions']:.0f} preemptions: the KV cache ran out and "
                f"requests were recomputed; give the server fewer agents "
                f"(server.samples_per_server), more GPUs or a shorter context."
            )
        if f["queue_mean_s"] is not None and f["queue_mean_s"] > QUEUE_CEILING_S:
            out.append(
                f"{s.name}: requests waited {f['queue_mean_s']:.1f} s on average for a slot; "
                f"the server has more agents than it runs at once (server.samples_per_server)."
            )
    slow = [s for s in samples if (s.iteration_p50_s or 0) > ITERATION_TARGET_S]
    if slow:
        worst = max(slow, key=lambda s: s.iteration_p50_s or 0)
        out.append(
            f"{len(slow)} of {len(samples)} samples took more than {ITERATION_TARGET_S:g} s per "
            f"iteration (median; slowest {worst.name}: {worst.iteration_p50_s:.1f} s); the "
            f"figure of seconds per iteration shows it, its sample page which steps."
        )
    cold = [s for s in samples if s.warm_hit_rate is not None and s.warm_hit_rate < HIT_RATE_FLOOR]
    if cold and not shards:
        out.append(
            f"{len(cold)} of {len(samples)} samples got less than {HIT_RATE_FLOOR:.0%} of their "
            f"prompt tokens from the prefix cache after the first step."
        )
    budget = sum(s.thinking_budget_hits or 0 for s in samples)
    if budget:
        out.append(
            f"{budget} steps hit the thinking budget: the model was cut short while thinking; "
            f"raise the budget if their calls went wrong."
        )
    return out


# (figure, header, format) of the tables; a figure not measured is left empty
SHARD_COLUMNS = (
    ("servers", "servers", "{:d}"),
    ("requests", "requests", "{:.0f}"),
    ("warm_hit_rate", "prefix-cache hit rate after warm-up", "{:.0%}"),
    ("prefix_cache_hit_rate", "hit rate, all", "{:.0%}"),
    ("spec_acceptance_rate", "MTP acceptance", "{:.0%}"),
    ("mean_accepted_length", "mean accepted length", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:.3g}"),
    ("decode_tokens_per_s", "decode tok/s per request", "{:.3g}"),
    ("generation_tokens_per_s", "generated tok/s, server", "{:.3g}"),
    ("queue_mean_s", "queue mean (s)", "{:.3g}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("kv_cache_usage", "KV usage at the end", "{:.0%}"),
)
SAMPLE_COLUMNS = (
    ("steps", "iterations", "{:d}"),
    ("iteration_p50_s", "s/iteration p50", "{:.3g}"),
    ("iteration_p95_s", "p95", "{:.3g}"),
    ("ttft_cold_s", "TTFT cold (s)", "{:.3g}"),
    ("ttft_warm_s", "TTFT warm (s)", "{:.3g}"),
    ("queue_p50_s", "queue p50 (s)", "{:.3g}"),
    ("warm_hit_rate", "cached after step 1", "{:.0%}"),
    ("decode_tokens_per_s", "decode tok/s", "{:.3g}"),
    ("thinking_tokens_per_step", "thinking tok/step", "{:.0f}"),
    ("thinking_budget_hits", "budget hits", "{:d}"),
)
SAMPLES_SHOWN = 40  # the slowest, in a larger cohort


def _cell(value: Any, form: str) -> str:
    return "" if value is None else form.format(value)


def view(perf: Performance) -> dict[str, Any]:
    """What the section shows: a note on what was measured, the verdicts, and two tables as text
    (headers, rows with the name first; samples slowest first)."""
    shards = [
        [
            s.name,
            *(
                _cell({**s.figures, "warm_hit_rate": s.warm_hit_rate, "servers": s.servers}[k], f)
                for k, _, f in SHARD_COLUMNS
            ),
        ]
        for s in perf.shards
    ]
    slowest = sorted(perf.samples, key=lambda s: -(s.iteration_p95_s or 0.0))[:SAMPLES_SHOWN]
    samples = [[s.name, *(_cell(getattr(s, k), f) for k, _, f in SAMPLE_COLUMNS)] for s in slowest]
    if perf.empty:
        note = NO_SERVER + ": every sample used the reference or replay policy"
    elif not perf.shards:
        note = (
            "no server figures (an external server, or no --server-metrics files): the figures "
            "below come from the agents' own metrics"
        )
    else:
        note = SERVED
    return {
        "note": note,
        "verdicts": perf.verdicts,
        "shard_headers": ["shard", *(h for _, h, _ in SHARD_COLUMNS)],
        "shards": shards,
        "sample_headers": ["sample", *(h for _, h, _ in SAMPLE_COLUMNS)],
        "samples": samples,
        "samples_left": len(perf.samples) - len(slowest),
    }


def build(samples: list[Sample], server_metrics: list[Path]) -> Performance:
    """The section for ``samples``, with the servers of ``server_metrics`` that served them."""
    files = {p: read_appended_rows(p) for p in server_metrics if p.is_file()}
    asked = [(s, f) for s in samples if (f := sample_figures(s)) is not None]
    used = servers_used([s for s, _ in asked], {metrics.shard_of(p): r for p, r in files.items()})
    shards = [
        load_shard(p, mine)
        for p, rows in files.items()
        if (mine := [r for r in rows if (metrics.shard_of(p), r.get("started")) in used])
    ]
    figures = [f for _, f in asked]
    return Performance(shards, figures, verdicts(shards, figures))

"""Server figures: vLLM's Prometheus names parsed into per-shard rows, the figures people read,
`agent serve status|metrics`, and the report's performance section with its verdicts."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agent.record.collect import Sample
from agent.record.durable import read_appended_rows
from agent.record.world_state import WorldState
from agent.report.build import build_report
from agent.report.performance import NO_SERVER, build, view
from agent.serve import metrics

AGENT = [sys.executable, "-m", "agent"]


def exposition(queries: float, hits: float, drafts: float, accepted: float, ttfts: list[float]):
    """vLLM's series as its two engines expose them (prometheus_client writes the text)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    engines = [("m", "0"), ("m", "1")]

    def counter(name: str, total: float) -> None:
        c = Counter(f"vllm:{name}", name, labels, registry=registry)
        for engine in engines:
            c.labels(*engine).inc(total / 2)

    counter("prefix_cache_queries", queries)
    counter("prefix_cache_hits", hits)
    counter("spec_decode_num_drafts", drafts)
    counter("spec_decode_num_draft_tokens", 2 * drafts)
    counter("spec_decode_num_accepted_tokens", accepted)
    counter("num_preemptions", 3)
    counter("generation_tokens", drafts)
    counter("request_success", len(ttfts))
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p", [*labels, "position"],
                      registry=registry)  # fmt: skip
    per_pos.labels("m", "0", "0").inc(accepted * 0.75)
    per_pos.labels("m", "0", "1").inc(accepted * 0.25)
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=registry)
    kv.labels("m", "0").set(0.2)
    kv.labels("m", "1").set(0.4)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", labels, registry=registry,
                     buckets=(0.1, 0.5, 1.0, 5.0))  # fmt: skip
    for t in ttfts:
        ttft.labels("m", "0").observe(t)
    return generate_latest(registry).decode()


def test_vllm_series_become_the_headline_figures():
    series = metrics.parse(exposition(1000, 900, 10, 8, [0.2, 0.3, 0.7, 2.0]))
    assert series["prefix_cache_queries"] == 1000 and series["num_preemptions"] == 3
    assert series["spec_decode_num_accepted_tokens_per_pos"] == [6, 2]
    f = metrics.figures(series)
    assert f["prefix_cache_hit_rate"] == pytest.approx(0.9)
    assert f["spec_acceptance_rate"] == pytest.approx(0.4)  # 8 of 20 draft tokens
    assert f["mean_accepted_length"] == pytest.approx(1.8)  # 1 + 8 / 10 drafts
    assert f["acceptance_per_position"] == pytest.approx([0.6, 0.2])
    assert f["kv_cache_usage"] == pytest.approx(0.3)  # a share: averaged over engines
    assert 0.1 < f["ttft_p50_s"] <= 0.5  # the 2nd of 4 lies in (0.1, 0.5]
    assert f["running"] is None  # not in the exposition: not measured


def started(t0: float) -> str:
    """The ``started`` of a server whose launcher wrote its first row at ``t0``."""
    return dt.datetime.fromtimestamp(t0 - 5, dt.UTC).isoformat()


def shard_file(tmp_path, acceptance: float, starts=(0, 600)):
    """Rows of servers whose first rows came at ``starts``, appended to one file (a retried job,
    or a later workflow run): counters restart from zero with each."""
    path = tmp_path / "shard000.metrics.jsonl"
    rows = []
    for t0 in starts:
        for k, (queries, hits) in enumerate([(0, 0), (10_000, 1_000), (20_000, 10_000)]):
            text = exposition(queries, hits, 100 * k, 200 * k * acceptance, [0.3] * 3 * k)
            rows.append({"time": t0 + 15 * k, "started": started(t0), **metrics.parse(text)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def llm_sample(name: str, cached: int, server: str | None = None, times=(10, 20, 610, 620)):
    """A model's run of four steps at ``times``, its record naming ``server`` (None: a record
    made before records named their server)."""
    rows = [
        {"step": i, "decide_seconds": 4.0, "tool_seconds": 0.5, "prompt_tokens": 1000,
         "cached_tokens": 0 if i == 1 else cached, "completion_tokens": 40,
         "reasoning_tokens": 30, "ttft_seconds": 2.0 if i == 1 else 0.2, "decode_seconds": 0.5,
         "time": t}
        for i, t in enumerate(times, 1)
    ]  # fmt: skip
    world = WorldState(meta={"server": {"started_at": server} if server else None})
    return Sample(name, Path("."), Path("w.json"), "finished", world, metrics=rows)


def test_underdelivering_layers_get_a_verdict(tmp_path):
    # a run resumed on the retried server: two steps on each
    resumed = llm_sample("s1", 900, server=started(600))
    perf = build([resumed], [shard_file(tmp_path, 0.3), tmp_path / "gone.jsonl"])
    [shard] = perf.shards
    assert (shard.name, shard.servers) == ("shard000", 2)
    assert shard.warm_hit_rate == pytest.approx(0.9)  # 9,000 of 10,000 after the first interval
    assert shard.figures["prefix_cache_hit_rate"] == pytest.approx(0.5)  # both servers, in all
    assert shard.figures["preemptions"] == 6  # 3 per server
    assert shard.figures["generation_tokens_per_s"] == pytest.approx(400 / 60)  # 30 s per server
    words = " ".join(perf.verdicts)
    assert "MTP drafts were accepted 30%" in words and "preemptions" in words
    assert "prefix cache served" not in words  # 90% after warm-up
    assert "took more than 3 s per iteration" in words  # 4.5 s each
    [s] = perf.samples
    assert (s.ttft_cold_s, s.ttft_warm_s, s.warm_hit_rate) == (2.0, 0.2, 0.9)
    assert s.decode_tokens_per_s == 78 and s.thinking_tokens_per_step == 30  # 39 after the 1st
    # intervals within each server, and a gap, not an interval, across the restart
    assert [len(p) > 1 for p in shard.series] == [True, True, False, True, True]
    table = view(perf)
    assert table["shards"][0][:2] == ["shard000", "2"] and table["samples"][0][0] == "s1"


def test_only_the_servers_that_served_the_records_shown_count(tmp_path):
    """A shard's file after two workflow runs, a day apart: run 1's server, then run 2's."""
    path = shard_file(tmp_path, 0.9, starts=(0, 86_400))
    run1, run2 = started(0), started(86_400)

    def servers(*samples: Sample) -> list[list[str]]:
        return [sorted(metrics.servers(s.rows)) for s in build(list(samples), [path]).shards]

    redone = llm_sample("s1", 900, server=run2, times=(86_410, 86_420, 86_425, 86_430))
    kept = llm_sample("s2", 900, server=run1, times=(10, 20, 25, 30))
    assert servers(redone) == [[run2]]
    [shard] = build([redone], [path]).shards
    assert shard.figures["preemptions"] == 3  # one server's, not both runs'
    # a rerun that kept every analysis served nothing: the servers that made them
    assert servers(kept) == [[run1]]
    assert servers(redone, kept) == [[run1, run2]]
    # records that name no server: the shard's newest
    assert servers(llm_sample("s3", 900, times=(86_410,))) == [[run2]]
    reference = Sample(
        "r", Path("."), Path("w.json"), "finished", metrics=[{"step": 1, "time": 10}]
    )
    assert servers(reference) == []


def test_a_run_without_a_model_server_says_so(demo_run, tmp_path):
    build_report([demo_run.world_state], [], tmp_path, server_metrics=[tmp_path / "none.jsonl"])
    page = (tmp_path / "index.html").read_text()
    assert 'id="performance"' in page and NO_SERVER in page


def test_status_of_a_missing_endpoint_file_is_a_usage_error(tmp_path):
    out = subprocess.run([*AGENT, "serve", "status", "--endpoint", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and f"endpoint file {tmp_path / 'x.json'}" in out.stderr


@pytest.mark.vllm
def test_sampler_and_status_against_the_running_server(vllm_server, tmp_path):
    """The sampler's start and closing rows around one request; `serve status|metrics` answer."""
    path = tmp_path / "s.metrics.jsonl"
    sampler = metrics.Sampler(vllm_server.base_url, path, 3600, "now")
    sampler.start()
    vllm_server.client().chat.completions.create(
        model=vllm_server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    sampler.close()
    first, last = read_appended_rows(path)
    assert last["request_success"] >= first["request_success"] + 1
    assert (
        last["time_to_first_token_seconds"]["count"] > first["time_to_first_token_seconds"]["count"]
    )
    endpoint = str(vllm_server.endpoint_file)
    out = subprocess.run([*AGENT, "serve", "status", "--endpoint", endpoint],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("up: ") and f"model: {vllm_server.model}" in out.stdout
    assert "--enable-prefix-caching" in out.stdout and "prefix-cache hit rate: " in out.stdout
    out = subprocess.run([*AGENT, "serve", "metrics", "--endpoint", endpoint, "--json"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["up"] and doc["figures"]["requests"] >= 1 and "prefix_cache_queries" in doc["series"]

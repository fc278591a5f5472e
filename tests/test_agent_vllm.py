"""The agent against a real vLLM server (CPU, tiny random-weight model): the LLM path end to end."""

import io
import json
import time
from collections import Counter
from typing import Annotated

import pytest
from pydantic import Field

from agent.config import RunConfig
from agent.context import ContextManager
from agent.loop import run_loop
from agent.policies.base import Decision, PromptTooLong, ToolCall
from agent.policies.llm import LLMPolicy
from agent.record.durable import read_appended_rows
from agent.record.layout import SampleLayout
from agent.record.world_state import WorldState
from agent.registry import ToolRegistry, tool
from agent.report.build import build_report
from agent.runner import run_sample
from agent.serve.metrics import metrics_path
from agent.testing.null_session import NullSession
from tests.fixtures_vllm import METRICS_INTERVAL_S

pytestmark = pytest.mark.vllm


def test_llm_run_with_the_real_tools(vllm_server, demo_run, tmp_path):
    """`agent run --policy llm` over the endpoint file: the real scanpy tool schemas go to vLLM, the
    (random) model's calls are recorded, valid or not, with usage, cached tokens and calibration."""
    outdir = tmp_path / "llm"
    config = RunConfig(
        input=demo_run.input,
        outdir=outdir,
        sample="pbmc2",
        policy="llm",
        endpoint_file=vllm_server.endpoint_file,
        max_steps=6,
        max_tokens=48,
    )
    status = run_sample(config)
    assert status in {"step_limit", "repeated_failures", "finished"}
    world = WorldState.load(outdir / "world_state.json")
    assert world.meta["model"] == vllm_server.model
    assert world.meta["context_limit"] == vllm_server.max_model_len  # taken from the server
    assert world.meta["server_flags"]  # the flags and reasons of the endpoint file
    assert len(world.entries) >= 1 and all(e.status in {"ok", "error"} for e in world.entries)
    rows = [json.loads(x) for x in (outdir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] > 5000 for r in rows)  # the tool schemas alone are ~5K tokens
    assert rows[-1]["cached_tokens"] > 0.5 * rows[-1]["prompt_tokens"]  # the prefix cache serves
    for r in rows[1:]:  # calibrated from the first reply: the estimate never falls short by much
        assert r["estimated_prompt_tokens"] >= 0.97 * r["prompt_tokens"]
        assert r["estimated_prompt_tokens"] <= 1.3 * r["prompt_tokens"]
    # the server's own figures, sampled by its launcher, in the report's performance section
    shard, ended = metrics_path(vllm_server.endpoint_file), time.time()
    deadline = time.monotonic() + 10 * METRICS_INTERVAL_S
    while read_appended_rows(shard)[-1]["time"] < ended and time.monotonic() < deadline:
        time.sleep(0.5)  # until a row after the run's last request
    rows = read_appended_rows(shard)
    assert rows[-1]["prefix_cache_hits"] > 0
    assert world.meta["server"]["started_at"] == rows[0]["started"]  # its server
    build_report([outdir / "world_state.json"], [], tmp_path / "report", server_metrics=[shard])
    page = (tmp_path / "report" / "index.html").read_text()
    assert 'id="performance-shards"' in page and "Model servers over the run" in page
    assert "<td>pbmc2</td>" in page.split('id="performance-samples"')[1]


@tool("qc", mutates=False)
def inspect_data(session: object) -> dict:
    """Report the current table (large)."""
    return {
        "rows": [{"gene": f"GENE{i}", "mean": i * 0.25, "dispersion": i % 7} for i in range(60)]
    }


@tool("finish", mutates=False)
def finish(session: object, summary: Annotated[str, Field(max_length=20)] = "") -> dict:
    """End the analysis."""
    return {"done": True}


class ScriptedCalls(LLMPolicy):
    """Sends every prompt to the real server (which counts it and refuses one that is too long)
    but runs a fixed call, since a random-weight model rarely emits a usable one (seen here:
    85 of 85 replies cut at max_tokens with `required` and with a named tool_choice). What is
    under test is the prompt the agent builds, not the model's choices."""

    overflows = 0

    def decide(self, messages, tools, world):
        try:
            reply = super().decide(messages, tools, world)
        except PromptTooLong:
            ScriptedCalls.overflows += 1
            raise
        call = ToolCall(f"call{world.next_step}", "inspect_data", "{}")
        return Decision([call], reply.text, reply.usage, reply.finish_reason)


@pytest.mark.slow
def test_long_session_survives_a_small_context(vllm_server, tmp_path):
    policy = ScriptedCalls(
        vllm_server.base_url,
        vllm_server.model,
        api_key=vllm_server.api_key,
        max_tokens=8,
        timeout=120,
        # thinking off: a random model never closes its thought, and each reply cut while
        # thinking would double the next one's budget; what is under test is the prompt
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    registry = ToolRegistry([inspect_data, finish])
    ctx = ContextManager(
        "You analyse data with tools.",
        registry.schemas(),
        policy.context_limit(),
        completion_reserve=8,
        safety_margin=64,
    )
    ctx.add_user("Inspect the data repeatedly.")
    world = WorldState(meta={"sample": "long"})
    status = run_loop(
        policy,
        registry,
        NullSession(),
        world,
        ctx,
        SampleLayout(tmp_path),
        max_steps=85,
        max_failures=1000,
        log=io.StringIO(),
    )
    assert ScriptedCalls.overflows == 0  # zero context-length errors from the server
    saved = WorldState.load(tmp_path / "world_state.json")
    assert [e.step for e in saved.entries] == list(range(1, len(saved.entries) + 1))
    assert status == "step_limit" and len(saved.entries) == 85
    seen = Counter((e.tool, e.status, (e.error or "")[:80]) for e in saved.entries)
    assert sum(e.tool == "inspect_data" and e.status == "ok" for e in saved.entries) == 85, seen
    assert ctx.truncations > 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r["prompt_tokens"] for r in rows) + 8 <= vllm_server.max_model_len

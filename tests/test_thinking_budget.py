"""Thinking bounded per step and per-iteration timing: the catalogue's budgets, the server flags
that carry them, and a real run against the session's vLLM server."""

import orjson
import pytest

from agent.config import RunConfig
from agent.data.synthetic import DEMO_COHORT, write_sample
from agent.record.world_state import WorldState
from agent.runner import run_sample
from agent.serve import catalogue
from agent.serve.flags import select_flags
from agent.serve.gpu import resolve

TIMING = ("queue_seconds", "ttft_seconds", "decode_seconds")


def test_thinking_families_have_a_budget_the_reply_has_room_after():
    """Every family that thinks by default bounds its thought, below max_tokens so that the call
    still fits after it; a family without a reasoning parser has none (vLLM would refuse it)."""
    for family in catalogue.load().families.values():
        if family.thinking:
            assert family.thinking_budget and family.thinking_budget < family.max_tokens
        if family.reasoning_parser is None:
            assert family.thinking_budget is None, family.name


def test_explain_says_how_the_budget_and_the_timing_reach_the_server():
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 4096}  # fmt: skip
    plan = select_flags(resolve("cpu"), config)
    assert "--enable-per-request-metrics" in plan.argv()
    text = plan.explain()
    assert (
        "--reasoning-config" in text and "4096 tokens (the qwen3 family's thinking_budget)" in text
    )
    no_parser = select_flags(resolve("cpu"), config, {"reasoning_parser": "none"})
    assert "refuse a request's thinking_token_budget" in no_parser.explain()


@pytest.mark.vllm
def test_a_run_with_a_budget_records_it_and_times_each_step(vllm_server, tmp_path):
    """`agent run --thinking-budget`: the record's meta says the budget, every metrics row splits
    its decide time as the server measured it (queue, prefill to the first token, decode) and
    says whether the thought hit the budget, and meta counts the steps that did."""
    data = write_sample(DEMO_COHORT["pbmc2"], tmp_path / "data")
    config = RunConfig(
        input=data, outdir=tmp_path / "out", sample="pbmc2", policy="llm",
        endpoint_file=vllm_server.endpoint_file, max_steps=2, max_tokens=24, thinking_budget=8,
    )  # fmt: skip
    run_sample(config)
    world = WorldState.load(tmp_path / "out" / "world_state.json")
    assert world.meta["sampling"]["thinking_budget"] == 8
    rows = [
        orjson.loads(line)
        for line in (tmp_path / "out" / "metrics.jsonl").read_bytes().splitlines()
    ]
    assert rows
    for row in rows:
        assert all(row[key] is not None and row[key] >= 0 for key in TIMING), row
        assert row["ttft_seconds"] + row["queue_seconds"] <= row["decide_seconds"]
        assert row["decode_seconds"] <= row["decide_seconds"]
        assert row["thinking_budget_hit"] in (True, False)
        if row["thinking_budget_hit"]:
            assert row["reasoning_tokens"] >= 7  # the forced end took the 8th token's place
    hits = sum(r["thinking_budget_hit"] for r in rows)
    assert world.meta.get("thinking_budget_hits", 0) == hits

"""The parse path of every model family, for real: a real vLLM server (CPU) per family, with a tiny
random-weight model carrying that family's chat template and tokens, its own tool-call and
reasoning parsers, and replies forced by structured outputs to spell the reference recipe's calls
in the family's format (agent/testing/forced.py). The model's own output, parsed by the server,
is what the loop runs."""

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest

from agent.config import RunConfig
from agent.context import ContextManager, TokenCounter, tokenizer_estimate
from agent.data.synthetic import SampleSpec, write_sample
from agent.loop import run_loop
from agent.policies import make_policy
from agent.prompts import BRIEF, SYSTEM_PROMPT
from agent.record.layout import SampleLayout
from agent.record.world_state import WorldState
from agent.serve import gpu as gpus
from agent.serve.flags import select_flags
from agent.serve.kvplan import VLLM_TOLERANCE
from agent.serve.model_config import load_model_config
from agent.testing.forced import THOUGHTS, ForcedPolicy
from agent.testing.reference_run import run_reference
from agent.testing.tiny_model import blank_ids, marker_ids
from agent.tools import build_registry
from agent.tools.session import Session
from tests.fixtures_vllm import FAMILY_MODEL_LEN, reported_concurrency

pytestmark = pytest.mark.vllm

# 300 cells: every step of the recipe applies (scrublet needs 100+), each tool takes a moment
TINY = SampleSpec("tiny", 300, seed=7, format="h5ad", damaged_fraction=0.1, doublet_fraction=0.05)
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
MARKERS = ("<think>", "</think>", "<|channel>", "<channel|>", "<tool_call>", "<|tool_call>")


@pytest.fixture(scope="module")
def tiny_input(tmp_path_factory):
    return write_sample(TINY, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference_calls(tiny_input, tmp_path_factory):
    """The calls (tools and parameters, defaults filled in) of the reference policy alone."""
    _, world = run_reference(tiny_input, tmp_path_factory.mktemp("reference"))
    assert world.entries[-1].tool == "finish" and world.entries[-1].status == "ok"
    return [(e.tool, e.params) for e in world.entries]


def parsers(server) -> tuple[str, bool]:
    """The tool-call parser the catalogue gave the server, and whether the family thinks (has a
    reasoning parser and a thought format)."""
    family = server.endpoint.info["family"]
    return family["tool_call_parser"], bool(family["reasoning_parser"]) and family[
        "name"
    ] in THOUGHTS


def analyse(policy, setup, registry, tiny_input, outdir, max_steps):
    """The agent loop as the runner drives it, with ``policy`` deciding in the place of
    ``setup.policy``."""
    context = ContextManager(
        SYSTEM_PROMPT,
        registry.schemas(),
        setup.context_limit,
        completion_reserve=setup.max_tokens,
        counter=TokenCounter(tokenizer_estimate(setup.tokenizer)),
    )
    context.add_user(BRIEF.format(sample="tiny", input=tiny_input.name, brief=""))
    world = WorldState(meta={"sample": "tiny"})
    session = Session(outdir, seed=0, input_path=tiny_input)
    status = run_loop(
        policy,
        registry,
        session,
        world,
        context,
        SampleLayout(outdir),
        max_steps,
        log=io.StringIO(),
    )
    metrics = [json.loads(x) for x in (outdir / "metrics.jsonl").read_text().splitlines()]
    return status, world, context, metrics


def llm_config(server, tiny_input: Path, outdir: Path, max_tokens: int) -> RunConfig:
    return RunConfig(
        input=tiny_input,
        outdir=outdir,
        policy="llm",
        endpoint_file=server.endpoint_file,
        outage_wait=20,  # a server that died fails the test at once
        max_tokens=max_tokens,
    )


def test_a_reference_analysis_through_the_family_parser(
    family_server, tiny_input, reference_calls, tmp_path
):
    """Every call the loop runs came from the model's text through the server's parsers; the
    analysis equals the reference policy's, and no thought reaches the history."""
    family, model_dir, server = family_server
    assert server.endpoint.info["family"]["name"] == family
    parser, thinking = parsers(server)
    registry = build_registry()
    # the family's budget (thousands) would not fit this small context; the reference's
    # conclusion, written token by token, takes a few hundred
    setup = make_policy(llm_config(server, tiny_input, tmp_path, max_tokens=512), registry)
    policy = ForcedPolicy(
        setup.policy, registry, family, parser, marker_ids(model_dir), thinking=thinking
    )
    status, world, context, metrics = analyse(
        policy, setup, registry, tiny_input, tmp_path, max_steps=len(reference_calls) + 2
    )
    failed = [(e.step, e.tool, e.error) for e in world.entries if e.status != "ok"]
    assert status == "finished" and not failed, failed
    assert [(e.tool, e.params) for e in world.entries] == reference_calls
    assert all(e.call_id and not e.call_id.startswith("call-") for e in world.entries)  # server's
    history = json.dumps(context.history)
    assert not any(m in history for m in MARKERS)
    if thinking:
        assert len(policy.thoughts) == len(reference_calls)
        assert [(r or "").strip() for r in policy.reasoning] == policy.thoughts
        assert not any(t in history for t in policy.thoughts)
        assert all(r["reasoning_tokens"] > 5 for r in metrics)
    else:
        assert policy.reasoning == [None] * len(reference_calls)
        assert all(not r["reasoning_tokens"] for r in metrics)


def test_the_production_tool_grammar_writes_each_call(
    family_server, tiny_input, reference_calls, tmp_path
):
    """Where production constrains calls (catalogue strict_tools: the --tool-strict-level it
    passes), vLLM's own structural tag for the family writes each call, its arguments pinned by the
    tool's schema, and the family's parser reads back exactly the call that was pinned."""
    family, model_dir, server = family_server
    if not server.endpoint.info["family"]["strict_tools"]:
        pytest.skip(f"{family}: its parser builds no structural tag in vLLM 0.32")
    parser, thinking = parsers(server)
    registry = build_registry()
    setup = make_policy(llm_config(server, tiny_input, tmp_path, max_tokens=256), registry)
    setup.policy.thinking_off = thinking  # a thought is free text, which a random model never ends
    markers, blanks = marker_ids(model_dir), blank_ids(model_dir)
    policy = ForcedPolicy(
        setup.policy, registry, family, parser, markers, False, pinned=True, blanks=blanks
    )
    status, world, _, _ = analyse(policy, setup, registry, tiny_input, tmp_path, max_steps=3)
    assert status == "step_limit"
    assert [(e.tool, e.params, e.status) for e in world.entries] == [
        (tool, params, "ok") for tool, params in reference_calls[:3]
    ]
    assert all(e.call_id and not e.call_id.startswith("call-") for e in world.entries)


def test_a_reply_cut_while_thinking_is_recovered(family_server, tiny_input, tmp_path):
    """A thought cut at max_tokens is a recorded error naming the cut, and the next request
    has twice the budget; with thinking switched off, the family's template and parser give a
    call with no thought at all."""
    family, model_dir, server = family_server
    parser, thinking = parsers(server)
    if not thinking:
        pytest.skip(f"{family} does not think")
    registry = build_registry()
    setup = make_policy(llm_config(server, tiny_input, tmp_path, max_tokens=48), registry)
    llm = setup.policy
    llm.no_thinking = THINKING_OFF  # what the catalogue gives the thinking families
    policy = ForcedPolicy(llm, registry, family, parser, marker_ids(model_dir), True, endless=1)
    status, world, _, metrics = analyse(policy, setup, registry, tiny_input, tmp_path, 2)
    assert status == "step_limit"
    cut, loaded = world.entries
    assert cut.status == "error" and "cut while thinking" in cut.error
    assert "at max_tokens 48); next request: max_tokens 96" in cut.error
    assert metrics[0]["completion_tokens"] == 48 and metrics[0]["reasoning_tokens"] > 40
    assert loaded.tool == "load_data" and loaded.status == "ok" and llm.max_tokens == 96
    # what the last switch sends: thinking off, and the call still parses, thought-free
    llm.thinking_off = True
    reply = policy.decide(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "go"}],
        registry.schemas(),
        world,
    )
    assert [c.name for c in reply.calls] == ["call_cells"] and reply.reasoning is None


def test_the_kv_plan_holds_what_vllm_reserves(family_server):
    """The planner's requests of max_model_len that fit agree with the maximum concurrency vLLM
    reports at start-up for the family's real architecture (sliding windows with the whole
    prompt in flight on the CPU, linear-attention states in vLLM's hybrid pages, K=V global
    layers), within VLLM_TOLERANCE (a non-hybrid's rounding to whole blocks)."""
    family, model_dir, server = family_server
    max_len, concurrency = reported_concurrency(server.log_path)
    overrides = {"family": family, "agents": 1, "max_model_len": FAMILY_MODEL_LEN}
    plan = select_flags(gpus.cpu(1), load_model_config(model_dir), overrides).plan  # 1 GiB
    assert max_len == plan.max_model_len
    assert plan.concurrency(max_len) == pytest.approx(concurrency, rel=VLLM_TOLERANCE)
    if plan.shape.linear:  # Qwen3.5/3.6: prefix caching's align mode keeps two states a sequence
        assert plan.linear_states == 2
        one_state = replace(plan, linear_states=1).concurrency(max_len)
        assert one_state > concurrency * (1 + VLLM_TOLERANCE)  # as the planner counted before


@pytest.mark.parametrize("family_server", ["gemma4"], indirect=True)
def test_gemma4_with_thinking_off_over_several_tool_steps(
    family_server, tiny_input, reference_calls, tmp_path
):
    """Gemma 4 as the catalogue serves it (thinking off unless asked): its template with no
    thinking, several tool steps in a row parsed by the gemma4 parser, no thought anywhere."""
    family, model_dir, server = family_server
    parser, _ = parsers(server)
    registry = build_registry()
    setup = make_policy(llm_config(server, tiny_input, tmp_path, max_tokens=256), registry)
    policy = ForcedPolicy(setup.policy, registry, family, parser, marker_ids(model_dir), False)
    status, world, context, metrics = analyse(
        policy, setup, registry, tiny_input, tmp_path, max_steps=4
    )
    assert status == "step_limit"
    assert [(e.tool, e.params, e.status) for e in world.entries] == [
        (tool, params, "ok") for tool, params in reference_calls[:4]
    ]
    assert policy.reasoning == [None] * 4 and not any(r["reasoning_tokens"] for r in metrics)
    assert not any(m in json.dumps(context.history) for m in MARKERS)

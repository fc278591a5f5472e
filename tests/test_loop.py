"""The loop with scripted deciders and toy tools: the record, the metrics, and the stop rules."""

import io
import json
import os
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

from agent.context import ContextManager
from agent.loop import NO_CALL, run_loop
from agent.policies.base import Decision, ToolCall, Usage
from agent.policies.replay import ReplayPolicy
from agent.record.layout import SampleLayout
from agent.record.world_state import Entry, WorldState
from agent.registry import ToolRegistry, ToolSpec, tool


class Counter:
    """A toy session: one integer of state."""

    def __init__(self):
        self.value = 0
        self.checkpoints: list[int] = []
        self.done: set[str] = set()

    def digest(self) -> str:
        return f"v{self.value}"

    def after_step(self, step: int, tool: str, spec: ToolSpec) -> str | None:
        self.checkpoints.append(step)
        return f"checkpoints/step_{step:04d}.h5ad" if tool == "add" else None


@tool("preprocess")
def add(session: Counter, n: Annotated[int, Field(ge=1, le=10)] = 1) -> dict:
    """Add n."""
    session.value += n
    return {"value": session.value, "blob": "z" * 4000}


@tool("finish", mutates=False)
def finish(session: Counter) -> dict:
    """Stop."""
    return {"final": session.value}


class Scripted:
    def __init__(self, *decisions: Decision):
        self.decisions = list(decisions)
        self.seen: list[list[dict]] = []

    def decide(self, messages, tools, world):
        self.seen.append(messages)
        return self.decisions.pop(0)


def call(name: str, args: str, i: int) -> Decision:
    return Decision([ToolCall(f"c{i}", name, args)], usage=Usage(100 + i, 10, 50))


def go(
    policy, tmp_path: Path, limit: int = 100_000, **kw
) -> tuple[str, WorldState, ContextManager, str]:
    reg = ToolRegistry([add, finish])
    world = WorldState(meta={"sample": "S1"})
    ctx = ContextManager("instructions", reg.schemas(), context_limit=limit, completion_reserve=100)
    ctx.add_user("analyse S1")
    log = io.StringIO()
    status = run_loop(policy, reg, Counter(), world, ctx, SampleLayout(tmp_path), log=log, **kw)
    return status, world, ctx, log.getvalue()


def test_records_every_call_and_stops_on_finish(tmp_path):
    policy = Scripted(
        call("add", '{"n": 2}', 1),
        call("add", '{"n": 99}', 2),
        call("add", "{}", 3),
        call("finish", "{}", 4),
        call("add", "{}", 5),
    )
    status, world, _, log = go(policy, tmp_path)
    assert status == "finished"
    assert [(e.step, e.tool, e.status) for e in world.entries] == [
        (1, "add", "ok"),
        (2, "add", "error"),
        (3, "add", "ok"),
        (4, "finish", "ok"),
    ]
    assert world.entries[0].params == {"n": 2} and world.entries[2].params == {"n": 1}
    assert "less than or equal to 10" in world.entries[1].error
    assert (world.entries[0].digest_before, world.entries[0].digest_after) == ("v0", "v2")
    assert (world.entries[1].digest_before, world.entries[1].digest_after) == ("v2", "v2")
    assert world.entries[0].checkpoint == "checkpoints/step_0001.h5ad"
    assert world.entries[3].result == {"final": 3}
    saved = WorldState.load(tmp_path / "world_state.json")
    assert saved.entries == world.entries
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["prompt_tokens"] == 101 and rows[0]["cached_tokens"] == 50
    assert {"estimated_prompt_tokens", "estimate_error", "budget", "calibration"} <= rows[0].keys()
    assert log.splitlines()[1].startswith("[S1] step 2 add! ")
    assert "prompt 102 completion 10 cached 50" in log.splitlines()[1]


def test_world_state_is_rendered_first_then_appended_with_each_result(tmp_path):
    policy = Scripted(call("add", "{}", 1), call("finish", "{}", 2))
    go(policy, tmp_path)
    head = policy.seen[0][1]
    assert head["role"] == "user" and head["content"].startswith("WORLD STATE: 0 tool calls")
    assert head["content"].endswith("\n\nanalyse S1")  # the brief follows the rendering
    assert policy.seen[1][1] == head  # no step changes it
    last = policy.seen[1][-1]
    assert last["role"] == "tool" and last["content"].startswith("#1 add() -> value=1\n{")


def test_reply_without_tool_call_is_recorded_and_nudged(tmp_path):
    policy = Scripted(
        Decision(text="I think we are done", finish_reason="stop"),
        Decision(text='<tool_call>{"name": "add", "argu', finish_reason="length"),  # cut off
        call("finish", "{}", 2),
    )
    status, world, ctx, _ = go(policy, tmp_path)
    assert status == "finished"
    assert world.entries[0].tool == NO_CALL and "finish_reason=stop" in world.entries[0].error
    assert world.entries[1].tool == NO_CALL and "finish_reason=length" in world.entries[1].error
    assert ctx.history[-3]["role"] == "user" and "no valid tool call" in ctx.history[-3]["content"]


def test_repeated_failures_stop_with_a_clear_status(tmp_path):
    policy = Scripted(*[call("nope", "{}", i) for i in range(10)])
    status, world, _, _ = go(policy, tmp_path, max_failures=4)
    assert status == "repeated_failures" and len(world.entries) == 4


def test_step_limit(tmp_path):
    policy = Scripted(*[call("add", "{}", i) for i in range(10)])
    status, world, _, _ = go(policy, tmp_path, max_steps=3)
    assert status == "step_limit" and len(world.entries) == 3


def test_long_session_truncates_but_keeps_the_record(tmp_path):
    policy = Scripted(*[call("add", "{}", i) for i in range(60)], call("finish", "{}", 60))
    status, world, ctx, _ = go(policy, tmp_path, limit=20_000, max_steps=200)
    assert status == "finished" and len(world.entries) == 61
    assert ctx.truncations > 0
    assert all(len(str(m)) < 20_000 * 3 for m in policy.seen[-1])
    head = policy.seen[-1][1]["content"]  # rendered again at the last cut; the brief survives
    assert head.startswith("WORLD STATE: ") and not head.startswith("WORLD STATE: 0 ")
    assert head.endswith("\n\nanalyse S1")
    # truncation is rare: each cut leaves room for many steps, not on every step
    assert ctx.truncations <= len(world.entries) // 10


def test_replay_policy_repeats_successful_calls(tmp_path):
    first = tmp_path / "a"
    first.mkdir()
    _, recorded, _, _ = go(
        Scripted(call("add", '{"n": 3}', 1), call("add", '{"n": 0}', 2), call("finish", "{}", 3)),
        first,
    )
    again = tmp_path / "b"
    again.mkdir()
    status, world, _, _ = go(ReplayPolicy(recorded), again)
    assert status == "finished"
    assert [(e.tool, e.params, e.result) for e in world.entries] == [
        (e.tool, e.params, e.result) for e in recorded.entries if e.status == "ok"
    ]


@pytest.mark.parametrize("steps", [60])
def test_render_stays_compact(steps):
    from agent.context import TokenCounter

    world = WorldState()
    tools = [
        "qc_metrics",
        "filter_by_qc",
        "pca",
        "neighbors",
        "leiden",
        "rank_genes_groups",
        "plot",
    ]
    for i in range(1, steps + 1):
        ok = i % 9 != 0
        world.add(
            Entry(
                step=i,
                tool=tools[i % len(tools)],
                params={"resolution": 0.8, "n_pcs": 30, "key": "leiden"},
                status="ok" if ok else "error",
                result={
                    "n_cells": 2911,
                    "n_clusters": 9,
                    "sizes": list(range(40)),
                    "quantiles": {"p50": 1500.5, "p95": 4000.25},
                }
                if ok
                else None,
                error=None if ok else "leiden needs neighbors first: call neighbors",
                seconds=1.0,
                digest_before="a" * 32,
                digest_after="b" * 32,
            )
        )
    text = world.render()
    assert TokenCounter().raw(text) < 1000
    assert "#60 " in text and "#59 " in text  # the latest in full


class Checking(Scripted):
    """Checks before every decision that the record on disk is the whole record so far."""

    def __init__(self, outdir: Path, *decisions: Decision):
        super().__init__(*decisions)
        self.outdir, self.files = outdir, []

    def decide(self, messages, tools, world):
        record, copy = (
            self.outdir / "world_state.json",
            self.outdir / "checkpoints/world_state.json",
        )
        if world.entries:
            assert record.read_bytes() == world.to_json()
            assert os.path.samefile(record, copy) and record.stat().st_nlink == 2
            self.files.append(record.stat().st_ino)
        return super().decide(messages, tools, world)


def test_record_is_whole_after_every_step_and_saved_by_appending(tmp_path):
    policy = Checking(
        tmp_path, *[call("add", "{}", i) for i in range(12)], call("finish", "{}", 12)
    )
    status, world, _, _ = go(policy, tmp_path, max_steps=20)
    assert status == "finished" and len(policy.files) == 12
    assert len(set(policy.files)) == 2  # two files take turns, each extended in place
    spare = tmp_path / ".world_state.json.spare"
    # the spare is the record of the step before (the next save extends it); nothing else is left
    assert WorldState.load(spare).entries == world.entries[:-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".world_state.json.spare",
        "checkpoints",
        "metrics.jsonl",
        "world_state.json",
    ]
    assert WorldState.load(tmp_path / "checkpoints/world_state.json").entries == world.entries
    # a spare that another name links, or one of another meta, is not written to: a new file is
    os.link(spare, tmp_path / "mine.json")
    kept = (tmp_path / "mine.json").read_bytes()
    world.save_record(SampleLayout(tmp_path), step=True)
    assert (tmp_path / "mine.json").read_bytes() == kept
    assert (tmp_path / "world_state.json").read_bytes() == world.to_json()
    world.meta["note"] = "x"
    world.save_record(SampleLayout(tmp_path), step=True)
    assert (tmp_path / "world_state.json").read_bytes() == world.to_json()
    # any other save (the runner's last) writes the record anew and drops the spare
    world.save_record(SampleLayout(tmp_path))
    assert not spare.exists() and WorldState.load(tmp_path / "world_state.json") == world


def test_a_new_process_writes_no_file_it_did_not_write(tmp_path):
    go(Scripted(*[call("add", "{}", i) for i in range(3)]), tmp_path, max_steps=3)
    files = [tmp_path / ".world_state.json.spare", tmp_path / "world_state.json"]
    before = [f.read_bytes() for f in files]
    resumed = WorldState.load(tmp_path / "checkpoints/world_state.json")
    reg = ToolRegistry([add, finish])
    ctx = ContextManager("instructions", reg.schemas(), context_limit=100_000)
    policy = Scripted(*[call("add", "{}", i) for i in range(3, 6)], call("finish", "{}", 6))
    with open(files[0], "rb") as spare, open(files[1], "rb") as record:  # the files, not names
        status = run_loop(
            policy, reg, Counter(), resumed, ctx, SampleLayout(tmp_path), log=io.StringIO()
        )
        assert [spare.read(), record.read()] == before
    assert status == "finished"
    assert (tmp_path / "world_state.json").read_bytes() == resumed.to_json()
    assert len(resumed.entries) == 7


def test_record_format_and_records_written_before_rejected_arguments(tmp_path):
    """Entries keep the keys and order records always had, then their hash chain; a call refused
    before it ran adds its arguments as sent, and an older record's params._raw reads back into that field."""
    decisions = Scripted(call("add", '{"n": 99}', 1), call("finish", "{}", 2))
    status, _, _, _ = go(decisions, tmp_path)
    assert status == "finished"
    doc = json.loads((tmp_path / "world_state.json").read_text())
    refused, done = doc["entries"]
    assert list(done) == ["step", "tool", "params", "status", "result", "error", "seconds",
                          "digest_before", "digest_after", "call_id", "checkpoint",
                          "chain"]  # fmt: skip
    assert refused["params"] == {} and refused["rejected_arguments"] == '{"n": 99}'
    old = {k: v for k, v in refused.items() if k != "rejected_arguments"}
    old["params"] = {"_raw": '{"n": 99}'}
    entry = Entry.from_json(old)
    assert (entry.params, entry.rejected_arguments) == ({}, '{"n": 99}')
    assert 'add({"n": 99})' in WorldState(entries=[entry]).render()


def test_calls_after_finish_in_its_reply_are_refused_and_each_call_has_its_own_digests(tmp_path):
    """[add, finish, add] in one reply: the first add runs and is recorded with the data around
    it alone; finish ends the run; the last add is refused, not run, and recorded as refused."""
    reply = Decision(
        [ToolCall("a", "add", '{"n": 2}'), ToolCall("b", "finish", "{}"),
         ToolCall("c", "add", '{"n": 5}')],
        usage=Usage(100, 10, 50),
    )  # fmt: skip
    status, world, _, _ = go(Scripted(reply), tmp_path)
    assert status == "finished"
    first, done, after = world.entries
    assert (first.digest_before, first.digest_after) == ("v0", "v2")
    assert done.result == {"final": 2} and (done.digest_before, done.digest_after) == ("v2", "v2")
    assert after.status == "error" and after.rejected_arguments == '{"n": 5}'
    assert after.digest_after == "v2" and "nothing runs after finish" in after.error
    (refused,) = after.result["checks"]
    assert refused["rule"] == "after_finish" and refused["verdict"] == "refused"
    assert refused["evidence"] == {"finish_step": 2}

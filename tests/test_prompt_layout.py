"""The append-only prompt layout over real loop runs: what the model sees of the world state is the
record's, and a request only ever appends to the one before, except at a cut of the history.

"What the model sees" of the world state before a request is the rendering in the first user
message (made at the start or at the last cut, after k entries) and the line that starts each
tool result (or nudge) of an entry after the k-th. It equals the record's rendering in this sense:
(1) every line it holds is the record's own line for that entry (``WorldState.line``), (2) it
names every entry after the k-th exactly once, (3) every line of a fresh full rendering of the
record at that moment is among them (the per-tool summary's "(N calls)" aside), and every error
step the fresh rendering lists is there as a line or in the rendering's own error list.
"""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path

import pytest

from agent.context import ContextManager
from agent.loop import run_loop
from agent.policies.base import Decision, ToolCall, Usage
from agent.record.layout import SampleLayout
from agent.record.world_state import HEADER, WorldState
from agent.registry import ToolRegistry
from tests.test_loop import Counter, add, finish

LINE = re.compile(r"^#(\d+) ")
CALLS = re.compile(r" \(\d+ calls\)$")


class Recording:
    """Scripted calls; keeps a deep copy of every request's messages as they were sent."""

    def __init__(self, calls: list[tuple[str, str]]):
        self.calls = calls
        self.sent: list[list[dict]] = []

    def decide(self, messages, tools, world):
        self.sent.append(copy.deepcopy(messages))
        if world.next_step > len(self.calls):
            return Decision([ToolCall("end", "finish", "{}")], usage=Usage(10, 1, 0))
        if self.calls[world.next_step - 1] is None:
            return Decision(text="thinking", finish_reason="stop")  # no call: a nudge follows
        name, args = self.calls[world.next_step - 1]
        return Decision([ToolCall(f"c{world.next_step}", name, args)], usage=Usage(10, 1, 0))


def session(tmp_path: Path, steps: int, limit: int) -> tuple[Recording, WorldState, list[dict]]:
    # every 7th call is refused (n > 10), every 11th reply has no call; results of varied sizes
    calls = [
        None if i % 11 == 5 else ("add", json.dumps({"n": 99 if i % 7 == 3 else 1 + i % 10}))
        for i in range(steps)
    ]
    reg = ToolRegistry([add, finish])
    world = WorldState(meta={"sample": "S1"})
    ctx = ContextManager("instructions", reg.schemas(), context_limit=limit, completion_reserve=100)
    ctx.add_user("analyse S1")
    policy = Recording(calls)
    status = run_loop(
        policy, reg, Counter(), world, ctx, SampleLayout(tmp_path), max_steps=steps + 1,
        max_failures=100, log=io.StringIO(),
    )  # fmt: skip
    assert status == "finished"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return policy, world, rows


def seen_world_state(messages: list[dict]) -> tuple[int, list[str], list[str]]:
    """(k, the rendering's lines, the entry lines after the k-th) as the model reads them."""
    rendering = messages[1]["content"].split("\n\n")[0].splitlines()
    assert rendering[0].startswith(HEADER)
    k = int(rendering[0].split()[2])
    appended = []
    for m in messages[2:]:
        first = (m.get("content") or "").split("\n", 1)[0]
        hit = LINE.match(first)
        if m["role"] in ("tool", "user") and hit and int(hit.group(1)) > k:
            appended.append(first)
    return k, rendering, appended


@pytest.mark.parametrize("limit", [9_000, 30_000])
def test_the_model_sees_the_records_world_state_after_every_step(tmp_path, limit):
    policy, _, rows = session(tmp_path, steps=70, limit=limit)
    world = WorldState.load(tmp_path / "world_state.json")  # the record as saved
    defaults = ToolRegistry([add, finish]).defaults()
    assert rows[-1]["truncations"] > 0  # the runs cut their history: the rendering is rewritten
    for done, messages in enumerate(policy.sent):  # request i comes after i entries
        record = WorldState(entries=world.entries[:done])
        k, rendering, appended = seen_world_state(messages)
        # (1) the appended lines are the record's lines, (2) each entry after the k-th once
        assert appended == [record.line(e, defaults) for e in record.entries[k:]]
        # the rendering is the record's own as of the k-th entry
        assert rendering == WorldState(entries=world.entries[:k]).render(defaults=defaults).split(
            "\n"
        )
        # (3) a fresh rendering tells nothing the model has not seen
        seen = {CALLS.sub("", x) for x in rendering + appended}
        fresh = record.render(defaults=defaults).splitlines()
        assert {CALLS.sub("", x) for x in fresh if x.startswith("#")} <= seen
        listed = next((x for x in fresh if x.startswith("Earlier errors")), "")
        seen_errors = next((x for x in rendering if x.startswith("Earlier errors")), "")
        for step in re.findall(r"\d+", listed):
            assert any(x.startswith(f"#{step} ") for x in seen) or step in re.findall(
                r"\d+", seen_errors
            )


@pytest.mark.parametrize("limit", [9_000, 30_000])
def test_no_request_changes_an_earlier_byte_except_at_a_cut(tmp_path, limit):
    policy, _, rows = session(tmp_path, steps=70, limit=limit)
    cuts = 0
    # row i is the step decided by request i; its count of cuts says whether that request
    # followed a new one
    for before, after, row, prev in zip(policy.sent, policy.sent[1:], rows[1:], rows, strict=False):
        if row["truncations"] > prev["truncations"]:
            cuts += 1
            assert after[0] == before[0]  # the instructions (and the tools after them) stay
            assert row["reprefilled_tokens"] > 0
            continue
        assert row["reprefilled_tokens"] == 0
        assert after[: len(before)] == before  # every earlier message, byte for byte
        old, new = json.dumps(before)[:-1], json.dumps(after)
        assert new.startswith(old)  # the request as text: the old one is its prefix
    assert cuts == rows[-1]["truncations"] > 0
    assert [r["truncations"] for r in rows] == sorted(r["truncations"] for r in rows)

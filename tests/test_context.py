import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.context import ContextManager, ContextOverflow, TokenCounter, truncate
from agent.policies.base import Decision, ToolCall, Usage
from agent.registry import Outcome


def turn(i: int, size: int) -> list[dict]:
    return [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "t", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": f"c{i}", "name": "t", "content": "x" * size},
    ]


histories = st.lists(
    st.one_of(
        st.integers(0, 3000).map(lambda n: ("tool", n)),
        st.integers(0, 300).map(lambda n: ("user", n)),
    ),
    max_size=40,
).map(
    lambda items: [
        m
        for i, (kind, n) in enumerate(items)
        for m in (turn(i, n) if kind == "tool" else [{"role": "user", "content": "u" * n}])
    ]
)


@settings(max_examples=300, deadline=None)
@given(history=histories, budget=st.integers(50, 6000), keep=st.floats(0.0, 1.0))
def test_truncation_keeps_users_and_fits_or_says_why(history, budget, keep):
    counter = TokenCounter()
    users = [m for m in history if m["role"] == "user"]
    original = list(history)
    goal = int(budget * keep)
    try:
        truncate(history, counter, budget, goal)
    except ContextOverflow as e:
        assert "budget" in str(e)
        return
    assert sum(counter.scaled(counter.raw_message(m)) for m in history) <= budget
    assert [m for m in history if m["role"] == "user"] == users  # never a user message
    # every remaining tool result still follows the assistant turn that asked for it
    ids = {c["id"] for m in history if m["role"] == "assistant" for c in m.get("tool_calls", [])}
    assert all(m["tool_call_id"] in ids for m in history if m["role"] == "tool")
    if len(history) == len(original) and all(
        a is b for a, b in zip(history, original, strict=True)
    ):
        return  # nothing to do: it already fitted
    # a cut goes down to the goal, unless all that is left is untouchable (user messages and
    # the latest turn, its result a stub or too small to gain from one)
    total = sum(counter.scaled(counter.raw_message(m)) for m in history)
    assert total <= goal or sum(m["role"] == "assistant" for m in history) <= 1


def test_largest_tool_results_go_first_and_become_stubs():
    counter = TokenCounter()
    history = [{"role": "user", "content": "brief"}, *turn(1, 300), *turn(2, 9000), *turn(3, 600)]
    changed = truncate(history, counter, budget=1500, goal=1050)
    assert changed == 1
    stub = orjson.loads(history[4]["content"])
    assert stub["truncated"] is True and stub["tool"] == "t" and stub["removed_tokens"] > 2000
    assert "world state" in stub["note"]
    assert history[2]["content"] == "x" * 300 and history[6]["content"] == "x" * 600


def test_when_stubs_are_not_enough_oldest_turns_go_but_never_the_latest():
    counter = TokenCounter()
    history = [{"role": "user", "content": "brief"}]
    for i in range(30):
        history += turn(i, 30)
    truncate(history, counter, budget=300, goal=210)
    assert history[0] == {"role": "user", "content": "brief"}
    assert history[-1]["tool_call_id"] == "c29"  # the latest turn survives


def test_impossible_fit_is_a_clear_error():
    history = [{"role": "user", "content": "u" * 10_000}]
    with pytest.raises(ContextOverflow, match="budget is 100"):
        truncate(history, TokenCounter(), budget=100, goal=70)


def test_calibration_only_goes_up():
    c = TokenCounter()
    c.calibrate(100, 150)
    assert c.factor == 1.5
    c.calibrate(100, 120)  # an overestimate later does not lower it
    assert c.factor == 1.5
    assert c.scaled(100) == 150


def test_budget_subtracts_every_fixed_cost():
    tools = [{"type": "function", "function": {"name": "a" * 300}}]
    cm = ContextManager(
        "s" * 600, tools, context_limit=10_000, completion_reserve=1000, safety_margin=100
    )
    c = cm.counter
    expected = (
        10_000
        - c.raw(orjson.dumps(tools).decode())
        - c.raw_message({"content": "s" * 600})
        - c.raw_message({"content": "w" * 900})
        - 1000
        - 100
    )
    assert cm.budget("w" * 900) == expected
    c.factor = 2.0  # after calibration the fixed costs count double
    assert cm.budget("w" * 900) < expected


def test_prompt_layout_appends_each_step_and_renders_only_at_the_start():
    cm = ContextManager("instructions", [], context_limit=100_000)
    cm.add_user("analyse S1")
    renders = []

    def render():
        renders.append(1)
        return f"WORLD STATE: {len(renders)} rendering"

    first = cm.prompt(render)
    cm.add_decision(Decision([ToolCall("c1", "load_data", "{}")]))
    cm.add_result("c1", Outcome("load_data", {}, "ok", {"n_cells": 10}, None, 0.1), "#1 load")
    second = cm.prompt(render)
    assert len(renders) == 1  # no cut: the rendering of the start stays
    assert first == [
        {"role": "system", "content": "instructions"},
        {"role": "user", "content": "WORLD STATE: 1 rendering\n\nanalyse S1"},
    ]
    assert second[:2] == first and second[2]["role"] == "assistant"
    line, result = second[3]["content"].split("\n")
    assert line == "#1 load" and orjson.loads(result) == {"n_cells": 10}
    assert cm.last["truncations"] == 0 and cm.last["reprefilled_tokens"] == 0


def test_a_cut_leaves_room_for_the_planned_steps_of_measured_growth():
    cm = ContextManager("s", [], context_limit=20_000, completion_reserve=0, safety_margin=0)
    cm.plan_steps, cm.min_headroom = 6, 0.0
    cm.add_user("brief")
    steps, cuts = 0, []
    while len(cuts) < 3:
        cm.prompt(lambda: "WORLD STATE")
        if cm.last["reprefilled_tokens"]:
            cuts.append(steps)
            assert cm.last["reprefilled_tokens"] >= cm.last["history_tokens"]
            assert cm.last["history_tokens"] <= cm.last["budget"] - 6 * 350
        steps += 1
        cm.add_decision(Decision([ToolCall(f"c{steps}", "t", "{}")]))
        cm.add_result(f"c{steps}", Outcome("t", {}, "ok", {"x": "y" * 1000}, None, 0.1))
    assert cm.last["truncations"] == 3
    grown, n = cm._grown  # about 350 tokens a step, learnt from the steps themselves
    assert 330 < grown / n < 400
    assert min(b - a for a, b in itertools.pairwise(cuts)) >= 6  # room for 6 steps after each cut


def test_observe_reports_estimate_error_and_calibrates():
    cm = ContextManager("instructions", [], context_limit=100_000)
    cm.prompt(lambda: "w")
    est = cm.last["estimated_prompt_tokens"]
    cm.observe(Usage(prompt_tokens=est * 2, completion_tokens=5))
    assert cm.last["estimate_error"] == -est
    assert cm.counter.factor >= 1.9


@pytest.mark.parametrize("mode", ["none", "current_turn", "preserve"])
def test_thoughts_go_back_as_the_family_keeps_them_and_count_in_the_budget(mode):
    """current_turn: the thoughts since the last user message ride on their assistant turns and
    count as history; a user message drops the earlier ones (the template would) and the prompt
    says from where it changed. preserve keeps them all, none sends none."""
    cm = ContextManager("instructions", [], context_limit=100_000, history_reasoning=mode)
    cm.add_user("analyse S1")
    cm.prompt(lambda: "WORLD STATE")
    empty = cm.last["history_tokens"]
    cm.add_decision(Decision([ToolCall("c1", "t", "{}")], reasoning="why " * 300))
    cm.add_result("c1", Outcome("t", {}, "ok", {}, None, 0.1))
    before = cm.prompt(lambda: "WORLD STATE")
    kept = [m.get("reasoning") for m in before if m["role"] == "assistant"]
    assert kept == ([None] if mode == "none" else ["why " * 300])
    grown = cm.last["history_tokens"] - empty
    assert (grown > 300) == (mode != "none")  # the thought counts where it is sent
    cm.add_user("call a tool")  # a nudge: a new user turn
    after = cm.prompt(lambda: "WORLD STATE")
    assert any(m.get("reasoning") for m in after) == (mode == "preserve")
    assert after[: len(before)] == before or mode == "current_turn"
    # from the stripped turn on, the server prefills anew (the turn, now without its thought)
    assert (cm.last["reprefilled_tokens"] > 0) == (mode == "current_turn")
    assert cm.last["truncations"] == 0

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
@given(history=histories, budget=st.integers(50, 6000))
def test_truncation_keeps_users_and_fits_or_says_why(history, budget):
    counter = TokenCounter()
    users = [m for m in history if m["role"] == "user"]
    original = list(history)
    try:
        truncate(history, counter, budget)
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
    # hysteresis: a cut goes well below the budget, unless all that is left is untouchable
    # (user messages and the latest turn)
    total = sum(counter.scaled(counter.raw_message(m)) for m in history)
    assert total <= int(budget * 0.7) or sum(m["role"] == "assistant" for m in history) <= 1


def test_largest_tool_results_go_first_and_become_stubs():
    counter = TokenCounter()
    history = [{"role": "user", "content": "brief"}, *turn(1, 300), *turn(2, 9000), *turn(3, 600)]
    changed = truncate(history, counter, budget=1500)
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
    truncate(history, counter, budget=300)
    assert history[0] == {"role": "user", "content": "brief"}
    assert history[-1]["tool_call_id"] == "c29"  # the latest turn survives


def test_impossible_fit_is_a_clear_error():
    history = [{"role": "user", "content": "u" * 10_000}]
    with pytest.raises(ContextOverflow, match="budget is 100"):
        truncate(history, TokenCounter(), budget=100)


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


def test_prompt_layout_keeps_the_prefix_stable_across_steps():
    cm = ContextManager("instructions", [], context_limit=100_000)
    cm.add_user("analyse S1")
    first = cm.prompt("WORLD STATE: 0 tool calls")
    cm.add_decision(Decision([ToolCall("c1", "load_data", "{}")]))
    cm.add_result("c1", Outcome("load_data", {}, "ok", {"n_cells": 10}, None, 0.1))
    second = cm.prompt("WORLD STATE: 1 tool call")
    assert first[0] == {"role": "system", "content": "instructions"}
    assert second[: len(first) - 1] == first[:-1]  # everything but the world state is a prefix
    assert second[-1] == {"role": "user", "content": "WORLD STATE: 1 tool call"}
    assert second[-2]["role"] == "tool" and orjson.loads(second[-2]["content"]) == {"n_cells": 10}


def test_observe_reports_estimate_error_and_calibrates():
    cm = ContextManager("instructions", [], context_limit=100_000)
    cm.prompt("w")
    est = cm.last["estimated_prompt_tokens"]
    cm.observe(Usage(prompt_tokens=est * 2, completion_tokens=5))
    assert cm.last["estimate_error"] == -est
    assert cm.counter.factor >= 1.9

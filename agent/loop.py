"""The agent loop: plan -> tool call -> result -> world-state entry -> budget -> truncate -> plan.

The prompt carries the world state as agent/context.py lays it out: the full rendering at the
start and at each cut, and each entry's line beside its tool result in between.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import orjson

from agent import signals
from agent.checks import check
from agent.context import ContextManager
from agent.endpoint import PolicyUnavailable
from agent.policies.base import (
    Decision,
    Policy,
    PromptTooLong,
    Timing,
    ToolCall,
)
from agent.record.layout import SampleLayout
from agent.record.models import MetricsRow, RunMeta
from agent.record.world_state import Entry, WorldState
from agent.registry import Outcome, ToolRegistry
from agent.tool_declarations import CALL_CELLS, FINISH, LOAD

NO_CALL = "(no tool call)"
NUDGE = "Your last reply had no valid tool call. Call one of the tools; call finish when the analysis is done."


def run_loop(
    policy: Policy,
    registry: ToolRegistry,
    session: Any,
    world: WorldState,
    context: ContextManager,
    layout: SampleLayout,
    max_steps: int = 120,
    max_failures: int = 6,
    log: TextIO | None = None,
) -> str:
    """Run until `finish` succeeds ("finished", or "partial" where finish was told the analysis
    cannot be completed; calls after it in its reply are refused), the step limit, or too many
    failures in a row ("repeated_failures"; "input_refused" when no load_data succeeded). A reply
    without a tool call after load_data failed, with none succeeded, gives up on the input:
    "input_refused" at once, as nudging cannot make the input readable."""
    log = log or sys.stderr  # looked up per call: a caller may have swapped stderr since import
    defaults, schemas = registry.defaults(), registry.schemas()
    digest, failures, overflows = session.digest(), 0, 0
    while world.next_step <= max_steps:
        signals.check()  # a stop whose raise a finalizer swallowed ends the run here
        messages = context.prompt(lambda: world.render(defaults=defaults))
        t0 = time.perf_counter()
        try:
            decision = policy.decide(messages, schemas, world)
        except PolicyUnavailable as e:  # the record keeps what was waited out before it failed
            _record_outages(world, e.outages)
            raise
        except PromptTooLong as e:  # our estimate was low: learn from it and cut harder
            overflows += 1
            if overflows > 3:
                raise
            context.observe_overflow(e.prompt_tokens)
            continue
        think = time.perf_counter() - t0
        if decision.outages:
            _record_outages(world, decision.outages)
        if decision.thinking_budget_hit is not None:  # a budget was sent: count (0 included)
            hits = world.meta.get("thinking_budget_hits", 0) + decision.thinking_budget_hit
            # steps whose thought the server closed
            world.meta.update(RunMeta.part(thinking_budget_hits=hits))
        if not decision.calls and decision.finish_reason == "stop" and input_refusal(world):
            return "input_refused"
        context.observe(decision.usage)
        context.add_decision(decision)
        outcomes: list[tuple[str | None, Outcome]] = []
        ended: tuple[int, str] | None = None  # finish's step and the status it gave the run
        for call in decision.calls or [None]:
            if call is None:
                reason = f"reply had no tool call (finish_reason={decision.finish_reason})"
                outcome = Outcome(NO_CALL, {}, "error", None, reason, 0.0)
            elif ended is not None:
                outcome = after_finish(call, ended[0])
            else:
                outcome = registry.call(call.name, call.arguments, session)
            after = session.digest()
            entry = world.add(
                Entry(
                    **{**vars(outcome), "seconds": round(outcome.seconds, 4)},
                    step=world.next_step,
                    digest_before=digest,
                    digest_after=after,
                    call_id=call and call.id,
                )
            )
            digest = after
            if outcome.ok:
                entry.checkpoint = session.after_step(
                    entry.step, outcome.tool, registry.spec(outcome.tool)
                )
                if outcome.tool == FINISH:
                    ended = (entry.step, (outcome.result or {}).get("status", "finished"))
            line = world.line(entry, defaults)  # the entry travels with its result
            if call is None:
                context.add_user(NUDGE, line)
            else:
                context.add_result(call.id, outcome, line)
            failures = 0 if outcome.ok else failures + 1
            outcomes.append((entry.call_id, outcome))
        world.save_record(layout, step=True)
        _report(layout, log, world, decision, context, think, outcomes)
        if ended is not None:
            return ended[1]
        if failures >= max_failures:
            return "input_refused" if input_refusal(world) else "repeated_failures"
    return "step_limit"


def _record_outages(world: WorldState, outages: list[dict[str, Any]]) -> None:
    """The waits for the decider, added to the record's meta (a policy never edits the record)."""
    world.meta.setdefault("outages", []).extend(RunMeta.part(outages=outages)["outages"])


def after_finish(call: ToolCall, finish_step: int) -> Outcome:
    """A call of the reply that came after a successful finish: refused, not run, so the object
    written and the record's final numbers stay those of finish."""
    said = (
        f"{call.name} refused: finish succeeded at step {finish_step} in this reply and the "
        "analysis ended there; nothing runs after finish"
    )
    found = check("after_finish", "refused", said, finish_step=finish_step)
    return Outcome(call.name, {}, "error", {"checks": [found]}, said, 0.0, call.arguments)


def input_refusal(world: WorldState) -> str | None:
    """Why the input was refused: the last load_data error, when load_data failed and never
    succeeded; or the last call_cells verdict (droplets whose cells cannot be told from empty
    ones), when nothing succeeded after the data were loaded: not arguments the tool rejected,
    and not a run that went on past it. None otherwise."""
    loads = [e for e in world.entries if e.tool == LOAD]
    if not loads:
        return None
    loaded = [e.step for e in loads if e.status == "ok"]
    if not loaded:
        return loads[-1].error
    after = [e for e in world.entries if e.step > loaded[-1]]
    verdicts = [e for e in after if e.tool == CALL_CELLS and e.rejected_arguments is None]
    if verdicts and not any(e.status == "ok" for e in after):
        return verdicts[-1].error
    return None


def _report(
    layout: SampleLayout,
    log: TextIO,
    world: WorldState,
    decision: Decision,
    context: ContextManager,
    think: float,
    outcomes: list[tuple[str | None, Outcome]],
) -> None:
    """One progress line on stderr and one metrics line per iteration."""
    u = decision.usage
    row = MetricsRow(
        step=world.entries[-1].step,
        tools=[o.tool for _, o in outcomes],
        status=[o.status for _, o in outcomes],
        decide_seconds=round(think, 4),
        tool_seconds=round(sum(o.seconds for _, o in outcomes), 4),
        prompt_tokens=u.prompt_tokens if u else None,
        completion_tokens=u.completion_tokens if u else None,
        cached_tokens=u.cached_tokens if u else None,
        reasoning_tokens=u.reasoning_tokens if u else None,
        # the server's split of decide_seconds (vLLM per-request metrics; null where not sent)
        **vars(decision.timing or Timing()),
        thinking_budget_hit=decision.thinking_budget_hit,
        calibration=round(context.counter.factor, 4),
        time=time.time(),
        **context.last,
    )
    with open(layout.metrics, "ab") as f:
        f.write(orjson.dumps(row.row()) + b"\n")
    tokens = (
        f" | prompt {u.prompt_tokens} completion {u.completion_tokens} cached {u.cached_tokens}"
        if u
        else ""
    )
    names = ",".join(f"{o.tool}{'' if o.ok else '!'}" for _, o in outcomes)
    why = "; ".join(" ".join(o.error.split()) for _, o in outcomes if o.error)
    if len(why) > 160:  # one console line; the record keeps the whole reason
        why = why[:157] + "..."
    print(
        f"[{world.meta.get('sample', '?')}] step {row.step} {names} "
        f"{think + row.tool_seconds:.2f}s{tokens}{': ' + why if why else ''}",
        file=log,
        flush=True,
    )

"""A scripted agent session: the real loop and prompts, with recorded tool results in a fixed order.

Benchmarks of the serving side (prompt layout, prefix cache, concurrency, vLLM layers) need the
prompts of a real session: the real instructions, the 21 real tool schemas, tool results of real
sizes, the world state as the loop renders it. They do not need a model that chooses well (the
tiny test model writes noise) nor the seconds of scanpy. So every step asks the server for real,
through the policy the agent uses, and then sets its reply aside: the step that runs is the next
one of the script, and its result is the one a reference analysis recorded. Two runs of the same
script therefore send the same prompts, whatever the model answers.
"""

from __future__ import annotations

import argparse
import io
import itertools
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from agent.context import ContextManager
from agent.loop import run_loop
from agent.policies.base import Decision, Policy, ToolCall
from agent.prompts import BRIEF, SYSTEM_PROMPT
from agent.record.layout import SampleLayout
from agent.record.world_state import Entry, WorldState
from agent.registry import Outcome, ToolRegistry
from agent.testing.null_session import NullSession
from agent.tools import TOOLS

RECORD_SAMPLE = "pbmc2"  # the demo cohort's smallest sample: its reference run takes about a minute
EXPLORE_FROM = "cluster_sweep"  # past the recipe, the script revisits the steps from here on


def record_reference(workdir: Path, sample: str = RECORD_SAMPLE) -> Path:
    """Simulate a demo sample and analyse it with the reference policy; returns its world_state.json."""
    data, out = workdir / "data", workdir / "reference"
    for argv in (
        ["synth", "--sample", sample, "--outdir", str(data)],
        ["run", "--input", str(data / "counts.h5ad"), "--outdir", str(out), "--sample", sample],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "agent", *argv], capture_output=True, text=True, check=False
        )
        if done.returncode:
            raise RuntimeError(f"python -m agent {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return SampleLayout(out).record


def script(record: WorldState, steps: int | None = None) -> list[Entry]:
    """``steps`` recorded entries in the order they will run: the recipe, then a cycle over its
    exploration steps (sweep, clustering, markers, annotation, plots), ``finish`` last. None: the
    recorded run as it was.

    A repeated step's result is marked with its repeat number: a real session never sends the
    same result twice, and byte-identical repeats would let the prefix cache match text that
    only the script repeats (after a truncation, say).
    """
    entries = list(record.entries)
    if not entries or entries[-1].tool != "finish":
        raise ValueError("the record must end with a successful finish (a complete reference run)")
    *body, finish = entries
    steps = len(entries) if steps is None else steps
    if steps < 2:
        raise ValueError(f"steps={steps}: a session needs at least 2 steps")
    start = next((i for i, e in enumerate(body) if e.tool == EXPLORE_FROM), len(body) // 2)
    extra = itertools.islice(itertools.cycle(body[start:]), max(0, steps - 1 - len(body)))
    seen: Counter[tuple[str, str]] = Counter()
    out = []
    for e in [*body[: steps - 1], *extra, finish]:
        seen[e.tool, call_arguments(e)] += 1
        n = seen[e.tool, call_arguments(e)]
        out.append(replace(e, result={**e.result, "repeat": n}) if n > 1 and e.result else e)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-state",
        type=Path,
        help="a finished run's world_state.json to script the session from (default: a reference"
        f" analysis of the demo sample {RECORD_SAMPLE}, made first; about a minute)",
    )


def load_record(args: argparse.Namespace, workdir: Path, steps: int | None) -> list[Entry]:
    """The script of ``steps`` steps from --world-state, or from a fresh reference analysis."""
    path = args.world_state or record_reference(workdir / "record")
    try:
        return script(WorldState.load(path), steps)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: cannot script a session from it: {e}") from None


def call_arguments(entry: Entry) -> str:
    return orjson.dumps(entry.params).decode()


class ScriptedPolicy:
    """Asks ``inner`` (the LLM policy) for every step, keeps its usage, runs the script's call."""

    def __init__(self, inner: Policy, entries: list[Entry]):
        self.inner = inner
        self.entries = entries

    def decide(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], world: Any
    ) -> Decision:
        asked = self.inner.decide(messages, tools, world)
        entry = self.entries[world.next_step - 1]
        call = ToolCall(f"call-{world.next_step}", entry.tool, call_arguments(entry))
        return Decision(
            [call],
            None,
            asked.usage,
            "tool_calls",
            timing=asked.timing,
            thinking_budget_hit=asked.thinking_budget_hit,
        )


class ScriptedRegistry(ToolRegistry):
    """The real tools' schemas and defaults; each call returns the script's next recorded outcome.

    With ``sleep`` a call takes the seconds it took in the recorded run (the agent's own cores
    busy with scanpy while the server waits), otherwise none.
    """

    def __init__(self, entries: list[Entry], sleep: bool = False):
        super().__init__(TOOLS)
        self.queue = deque(entries)
        self.sleep = sleep

    def call(self, name: str, arguments: Any, session: Any) -> Outcome:
        e = self.queue.popleft()
        if (name, arguments) != (e.tool, call_arguments(e)):
            raise RuntimeError(f"script out of step: called {name} {arguments}, expected {e.tool}")
        if self.sleep:
            time.sleep(e.seconds)
        return Outcome(
            e.tool, e.params, e.status, e.result, e.error, e.seconds, e.rejected_arguments
        )


@dataclass
class SessionRun:
    status: str
    seconds: float
    rows: list[dict[str, Any]]  # metrics.jsonl as the loop wrote it, one row per step
    context: ContextManager

    def total(self, key: str, skip_first: bool = False) -> int:
        return sum(r[key] or 0 for r in self.rows[int(skip_first) :])


def tool_schemas() -> list[dict[str, Any]]:
    """The schemas of the agent's real tools, as every request sends them."""
    return ToolRegistry(TOOLS).schemas()


def new_context(context_limit: int, kind: type[ContextManager] = ContextManager) -> ContextManager:
    """The runner's context manager (same instructions, schemas and reserve) of class ``kind``."""
    return kind(SYSTEM_PROMPT, tool_schemas(), context_limit)


def run_session(
    policy: Policy,
    entries: list[Entry],
    context: ContextManager,
    outdir: Path,
    sample: str = "bench",
    sleep: bool = False,
) -> SessionRun:
    """One scripted session through the project's loop; its metrics rows and wall seconds."""
    outdir.mkdir(parents=True, exist_ok=True)
    layout = SampleLayout(outdir)
    layout.metrics.unlink(missing_ok=True)
    context.add_user(BRIEF.format(sample=sample, input="counts.h5ad", brief=""))
    world = WorldState(meta={"sample": sample})
    start = time.perf_counter()
    status = run_loop(
        ScriptedPolicy(policy, entries),
        ScriptedRegistry(entries, sleep),
        NullSession(),
        world,
        context,
        layout,
        max_steps=len(entries),
        log=io.StringIO(),
    )
    seconds = time.perf_counter() - start
    rows = [orjson.loads(line) for line in layout.metrics.read_bytes().splitlines()]
    return SessionRun(status, seconds, rows, context)

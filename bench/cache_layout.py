"""Prompt layouts side by side: prefix-cache hits and prefill over scripted agent sessions.

Every arm runs the same scripted session (bench/_script.py: the real loop, instructions, tool
schemas and recorded tool results; the model is asked at every step) against one real vLLM server,
its prefix cache emptied before each arm. Layouts:

  naive:  the world state rendered anew on every step inside the first system message, which the
          chat template renders before the tool schemas, so every step changes the prefix early;
  before: the layout before issue 16: the world state rendered anew and re-sent whole as the last
          message on every step, and a cut of the history down to a fixed 70% of its budget;
  new:    the project's ContextManager as it is: one rendering after the instructions (rewritten
          only at a cut), each entry's line with its tool result, cuts planned for growth;
  thoughts: new, for a family that sends the current turn's thoughts back (history_reasoning:
          current_turn, Qwen3/3.5/3.6, Gemma 4): every reply carries a thought of THOUGHT_CHARS
          characters (the tiny model, served without a reasoning parser, writes none) that the
          template renders into the later prompts.

Each layout runs at each ``--contexts`` size (the client's context limit; one server). Then, with
the new layout at the first size: a ``--long``-step session, ``--agents`` agents at once sharing
the server with their tools' recorded seconds between steps, and replies of the model's own
length (no ``ignore_eos``, up to ``--free-max-tokens``).

The model is the tiny random-weight Qwen3 build with a byte-level BPE of 32,768 tokens trained on a
broad corpus that ships on the machine (bench/_server.py, BROAD_CORPUS: Python's standard library
sources, /usr/share/doc, the environment's JSON files), whose compression of the agent's prompts
is close to a real model's (the 21 tool schemas: about 5.5K tokens); ``--model`` serves another.

Reported per arm: the share of prompt tokens the server served from its prefix cache after each
session's first request (usage cached_tokens), the tokens it prefilled per request, its prefill
seconds (vllm:request_prefill_time_seconds), the agent's request seconds, the cuts and the tokens
they re-prefilled (the context manager's estimate). Goal (issue 16): the new layout serves at
least 97% at 32K and 93% at 16K from cache.

    python -m bench.cache_layout [--iterations 80] [--contexts 32768,16384] [--long 200]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from agent.context import ContextManager, Message
from agent.policies.base import Decision, Policy
from agent.policies.llm import LLMPolicy
from agent.registry import Outcome
from bench import _report, _script, _server

GOALS = {32768: 0.97, 16384: 0.93}
PREFILL_SECONDS = "request_prefill_time_seconds"  # a histogram: its "sum"


class ResentContext(ContextManager):
    """The layout before issue 16: the full rendering re-sent last on every step, no entry lines
    with the results, and every cut down to 70% of the history budget."""

    def headroom(self, budget: int) -> int:
        return int(0.3 * budget)

    def prompt(self, render: Callable[[], str]) -> list[Message]:
        self.world_text = None  # rendered anew for every request
        system, head, *history = super().prompt(render)
        world, _, brief = head["content"].partition("\n\n")
        return [system, {**head, "content": brief}, *history, {"role": "user", "content": world}]

    def add_user(self, text: str, line: str | None = None) -> None:
        super().add_user(text)

    def add_result(self, call_id: str, outcome: Outcome, line: str | None = None) -> None:
        super().add_result(call_id, outcome)


class NaiveContext(ResentContext):
    """The rendering inside the first system message, before the tool schemas."""

    def prompt(self, render: Callable[[], str]) -> list[Message]:
        system, *history, world = super().prompt(render)
        content = f"{system['content']}\n\n{world['content']}"
        return [{"role": "system", "content": content}, *history]


THOUGHT_CHARS = 1200  # about 300 tokens of English: a short agentic thought per step


class ThoughtsContext(ContextManager):
    """The new layout keeping the current turn's thoughts, each reply given one of THOUGHT_CHARS."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, history_reasoning="current_turn", **kwargs)

    def add_decision(self, decision: Decision) -> None:
        n = len(self.history)
        words = f"Step {n}: the last result decides the next call, so check its figures first. "
        decision.reasoning = (words * (THOUGHT_CHARS // len(words) + 1))[:THOUGHT_CHARS]
        super().add_decision(decision)


LAYOUTS: dict[str, type[ContextManager]] = {
    "naive": NaiveContext,
    "before": ResentContext,
    "new": ContextManager,
    "thoughts": ThoughtsContext,
}


def measure(
    server: _server.Server,
    name: str,
    sessions: list[tuple[Policy, int, bool]],
    entries: list,
    work: Path,
) -> list[object]:
    """Run ``sessions`` ((policy, context limit, sleep) each, at once) of the layout that
    ``name`` starts with, from an empty cache; one table row."""
    layout = LAYOUTS[name.split()[0]]  # every arm is named after its layout
    server.reset_prefix_cache()
    before = server.metrics()[PREFILL_SECONDS]["sum"]
    runs: list = [None] * len(sessions)

    def one(i: int, policy: Policy, limit: int, sleep: bool) -> None:
        runs[i] = _script.run_session(
            policy, entries, _script.new_context(limit, layout), work / "arms" / f"{name}-{i}",
            sample=f"bench{i}", sleep=sleep,
        )  # fmt: skip

    threads = [threading.Thread(target=one, args=(i, *s)) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in runs):
        raise SystemExit(f"{name}: a session failed (see above)")
    prefill_s = server.metrics()[PREFILL_SECONDS]["sum"] - before
    prompt = sum(r.total("prompt_tokens", skip_first=True) for r in runs)
    cached = sum(r.total("cached_tokens", skip_first=True) for r in runs)
    requests = sum(len(r.rows) for r in runs)
    computed = sum(r.total("prompt_tokens") - r.total("cached_tokens") for r in runs)
    request_s = sum(r["decide_seconds"] for run in runs for r in run.rows)
    cuts = sum(r.context.truncations for r in runs)
    reprefilled = sum(r.total("reprefilled_tokens") for r in runs)
    print(f"{name}: done ({', '.join(sorted({r.status for r in runs}))})", flush=True)
    return [
        name, requests, f"{prompt:,}", f"{cached / prompt:.1%}", f"{computed / requests:,.0f}",
        f"{prefill_s:.1f}", f"{request_s:.1f}", cuts, f"{reprefilled / max(cuts, 1):,.0f}",
    ]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=80, help="agent steps per session")
    p.add_argument("--contexts", default="32768,16384", help="context limits of the layout arms")
    p.add_argument("--layouts", default="naive,before,new", help="layout arms to run")
    p.add_argument("--long", type=int, default=200, help="steps of the long arm (0: none)")
    p.add_argument("--agents", type=int, default=3, help="agents of the shared arm (0: none)")
    p.add_argument("--free-max-tokens", type=int, default=64, help="0: no free-length arm")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per step")
    p.add_argument("--workdir", type=Path, help="keep the server log and metrics here")
    _server.add_arguments(p)
    _script.add_arguments(p)
    args = p.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        p.error(f"--layouts: unknown {sorted(unknown)}; expected some of {list(LAYOUTS)}")
    _report.header("Prompt layouts and the prefix cache")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        built = None if args.model else _server.broad_model(work)
        entries = _script.load_record(args, work, max(args.iterations, args.long))
        short = entries[: args.iterations - 1] + entries[-1:]
        with _server.serve_from_args(
            args, work / "server", agents=max(args.agents, 1), built=built
        ) as server:
            limit = server.endpoint.max_model_len
            print(f"server ready in {server.startup_s:.0f} s; context {limit} tokens", flush=True)
            server.warm_up(_script.tool_schemas())
            fixed = server.policy(args.max_tokens)
            rows = [
                measure(server, f"{name} {size // 1024}K", [(fixed, size, False)], short, work)
                for size in contexts
                for name in layouts
            ]
            size = contexts[0]
            if args.long:
                rows.append(measure(server, f"new {size // 1024}K, {args.long} steps",
                                    [(fixed, size, False)], entries[: args.long], work))  # fmt: skip
            if args.agents:
                shared = [(server.policy(args.max_tokens), size, True) for _ in range(args.agents)]
                rows.append(measure(server, f"new {size // 1024}K, {args.agents} agents + tools",
                                    shared, short, work))  # fmt: skip
            if args.free_max_tokens:
                free = LLMPolicy(server.base_url, server.endpoint.model, server.api_key,
                                 max_tokens=args.free_max_tokens)  # fmt: skip
                rows.append(measure(server, f"new {size // 1024}K, free-length replies",
                                    [(free, size, False)], short, work))  # fmt: skip
    print()
    print(
        _report.table(
            ["arm", "requests", "prompt tokens", "cached after 1st", "prefilled / request",
             "prefill s (server)", "request s (agent)", "cuts", "re-prefilled / cut"],
            rows,
        )
    )  # fmt: skip
    for row in rows:
        name, share = str(row[0]), float(str(row[3]).rstrip("%")) / 100
        goal = GOALS.get(int(name.split()[1].rstrip("K,")) * 1024)
        if name.startswith("new") and goal is not None:
            verdict = "met" if share >= goal else f"NOT met, by {goal - share:.1%}"
            print(f"goal for {name}: >= {goal:.0%} from cache: {verdict} ({share:.1%})")
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

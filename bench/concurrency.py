"""Concurrency: samples per hour with 1, 2 and 4 agents sharing one vLLM server.

Each agent is a thread running the project's loop on its own sample (its own brief, world state
and history) through a scripted session (bench/_script.py): the real prompts are sent for every
step, and the recorded tool results come back. A sample is the whole recorded reference analysis
unless --steps says otherwise. Two kinds of agent are measured, in the same run:

  - tools take no time: every agent is always waiting on the server, so the ratio shows what
    the server's batching of several agents' requests buys;
  - tools take their recorded time (slept, as if scanpy ran on the agent's own cores, the way
    agent jobs run beside a shared GPU server): the ratio shows how far more agents fill the
    server's idle time.

The prefix cache is emptied before each level; the instructions and tool schemas the agents
share are then cached once for all of them, as on a real shared server.

    python -m bench.concurrency [--agents 1 2 4] [--tool-time both|none|recorded] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agent.record.world_state import Entry
from bench import _report, _script, _server

MODES = {"none": False, "recorded": True}


def run_level(
    server: _server.Server,
    entries: list[Entry],
    agents: int,
    sleep: bool,
    work: Path,
    max_tokens: int,
) -> tuple[float, list[_script.SessionRun]]:
    """``agents`` sessions at once; wall seconds until the last one finished, and the runs."""
    limit = server.endpoint.max_model_len
    jobs = [(server.policy(max_tokens), _script.new_context(limit)) for _ in range(agents)]
    server.reset_prefix_cache()
    start = time.perf_counter()
    with ThreadPoolExecutor(agents) as pool:
        futures = [
            pool.submit(
                _script.run_session,
                policy,
                entries,
                context,
                work / f"agent{k}",
                f"sample{k}",
                sleep,
            )
            for k, (policy, context) in enumerate(jobs)
        ]
        runs = [f.result() for f in futures]
    return time.perf_counter() - start, runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, nargs="+", default=[1, 2, 4], help="levels to measure")
    p.add_argument("--steps", type=int, help="steps per sample (default: the recorded analysis)")
    p.add_argument("--tool-time", choices=["both", *MODES], default="both")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per step")
    p.add_argument("--workdir", type=Path, help="keep the server log and metrics here")
    _server.add_arguments(p)
    _script.add_arguments(p)
    args = p.parse_args()
    if min(args.agents) < 1:
        p.error(f"--agents {args.agents}: every level needs at least one agent")
    _report.header("Concurrency: agents sharing one server")
    modes = list(MODES) if args.tool_time == "both" else [args.tool_time]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        entries = _script.load_record(args, work, args.steps)
        tool_s = sum(e.seconds for e in entries)
        print(f"a sample: {len(entries)} steps, {tool_s:.1f} s of recorded tool time", flush=True)
        with _server.serve_from_args(args, work / "server", agents=max(args.agents)) as server:
            print(f"server ready in {server.startup_s:.0f} s", flush=True)
            server.warm_up(_script.tool_schemas())
            for mode in modes:
                base = None
                for n in args.agents:
                    wall, runs = run_level(
                        server, entries, n, MODES[mode], work / f"{mode}-{n}", args.max_tokens
                    )
                    per_hour = n * 3600 / wall
                    base = base or per_hour
                    request = statistics.mean(r["decide_seconds"] for run in runs for r in run.rows)
                    label = f"tools {'recorded' if MODES[mode] else 'instant'}"
                    rows.append([
                        label, n, f"{wall:.1f}",
                        f"{per_hour:.0f}", _report.ratio(per_hour, base), f"{request:.2f}",
                    ])  # fmt: skip
                    print(f"{label}, {n} agent(s): {wall:.1f} s", flush=True)
    print()
    print(
        _report.table(
            [
                "tool time",
                "agents",
                "wall s",
                "samples/hour",
                f"vs {args.agents[0]} agent(s)",
                "mean request s",
            ],
            rows,
        )
    )
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

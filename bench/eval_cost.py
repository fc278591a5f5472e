"""What `agent eval` itself costs: points, seconds and tokens against an instant stand-in server.

The stand-in (agent/testing/scripted_server.py) answers every request at once with the reference
recipe's call at that point (from agent/eval/points.json), and each end-to-end analysis with the
recipe's calls of its case; so the time measured is the evaluation's own (building the cases,
walking the reference analyses, re-creating each prompt, executing and judging each decision,
the end-to-end analyses), and on a GPU the rest is the model's. Goal (issue 38): under 15
minutes here for every case.

    python -m bench.eval_cost [--cases all] [--end-to-end synthetic_pbmc,pbmc68k_reduced]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from agent.cli import main as agent
from agent.eval.cases import CASES
from agent.eval.points import read
from agent.testing.scripted_server import ScriptedServer
from bench import _report

GOAL_S = 15 * 60


def script(cases: list[str], end_to_end: list[str]) -> list[dict]:
    """The reference's call at each point in the order the evaluation asks, then each
    end-to-end case's calls."""
    points = read()

    def replies(case: str) -> list[dict]:
        return [
            {"tool": p.reference["tool"], "arguments": json.dumps(p.reference["arguments"])}
            for p in points.get(case, [])
        ]

    return [r for c in cases for r in replies(c)] + [r for c in end_to_end for r in replies(c)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="all", help="comma-separated cases, or all")
    p.add_argument("--end-to-end", default="synthetic_pbmc,pbmc68k_reduced")
    args = p.parse_args()
    cases = list(CASES) if args.cases == "all" else args.cases.split(",")
    e2e = [c for c in args.end_to_end.split(",") if c]
    _report.header("The cost of agent eval against an instant stand-in server")
    print(_report.load_line("at start"))
    server = ScriptedServer(max_model_len=200_000)
    server.script = script(cases, e2e)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        argv = ["eval", "--outdir", tmp, "--base-url", server.base_url, "--model", "scripted",
                "--cases", ",".join(cases), "--end-to-end", ",".join(e2e) or "none"]  # fmt: skip
        try:
            assert agent(argv) == 0
        finally:
            server.close()
        seconds = time.perf_counter() - t0
        doc = json.loads((Path(tmp) / "eval.json").read_text())
    prompt = sum(_tokens(body) for body in server.requests)
    rows = [
        [name, c.get("points", "-"), c.get("acceptable", "-"), "" if c["evaluated"] else c["why"]]
        for name, c in doc["cases"].items()
    ]
    print(_report.table(["case", "points", "acceptable", "note"], rows, left=1))
    runs = [[name, r["status"], r["steps"]] for name, r in doc["end_to_end"].items()]
    if runs:
        print(_report.table(["end to end", "status", "steps"], runs, left=1))
    print(
        f"\n{len(doc['points'])} points, {len(server.requests)} requests, about "
        f"{prompt:,} prompt tokens (the stand-in's count: ~3 characters a token); "
        f"score {doc['score']}; {seconds:.0f} s in all"
    )
    verdict = "met" if seconds <= GOAL_S else "NOT met"
    print(f"goal: under {GOAL_S // 60} minutes: {verdict} ({seconds / 60:.1f} min)")
    print(_report.load_line("at end"))


def _tokens(body: dict) -> int:
    return ScriptedServer.tokens(json.dumps(body.get("tools", [])) + json.dumps(body["messages"]))


if __name__ == "__main__":
    main()

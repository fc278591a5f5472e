"""`python -m agent eval`: score a served model's decisions and speed before a cohort runs on it.

Writes OUTDIR/eval.json (an overall ``score`` from 0 to 1 over every decision point, ``by_kind``,
every point's decision and verdict, the end-to-end analyses, the speed figures, the model, server
and GPU) and OUTDIR/eval.html. ``--regenerate-points`` writes agent/eval/points.json anew from
the reference analyses alone (no model).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

from agent import say
from agent.eval.cases import CASES

DEFAULT_END_TO_END = ("synthetic_pbmc", "pbmc68k_reduced")


def _names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n] if text != "none" else []
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {', '.join(unknown)}; the cases: {', '.join(CASES)}"
        )
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--outdir", type=Path, required=True, help="where eval.json and eval.html go")
    who = p.add_argument_group("the model (as agent run takes it)")
    who.add_argument("--endpoint-file", type=Path, help="endpoint JSON of `agent serve`")
    who.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. http://host:8000/v1")
    who.add_argument("--model", help="model name on that server")
    who.add_argument("--api-key-file", type=Path, help="file holding the server's API key")
    who.add_argument(
        "--policy", choices=("llm", "reference"), default="llm",
        help="llm: the served model; reference: the reference recipe (scores 1 by construction)",
    )  # fmt: skip
    who.add_argument("--max-tokens", type=int, help="completion limit per reply")
    who.add_argument("--no-thinking", action="store_true", help="switch thinking off")
    who.add_argument("--thinking-budget", type=int, help="thinking tokens per reply (0: none)")
    who.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    who.add_argument("--context-limit", type=int, default=32768,
                     help="the context limit where the server names none")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the analyses")
    p.add_argument(
        "--cases", type=_names, default=None,
        help=f"comma-separated cases (default: all): {', '.join(CASES)}",
    )  # fmt: skip
    p.add_argument(
        "--end-to-end", type=_names, default=list(DEFAULT_END_TO_END),
        help="cases the model also analyses on its own, scored by outcome ('none': no such run)",
    )  # fmt: skip
    p.add_argument("--max-steps", type=int, default=80, help="tool calls of an end-to-end run")
    p.add_argument(
        "--regenerate-points", action="store_true",
        help="write agent/eval/points.json from the reference analyses (no model asked)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Exit status 0 when the evaluation ran (whatever the score); 1 when the server failed it;
    2 for options that cannot work."""
    from agent.endpoint import PolicyUnavailable
    from agent.eval.page import render
    from agent.eval.run import evaluate
    from agent.record.durable import publish
    from agent.registry import InfrastructureError

    named = args.endpoint_file or (args.base_url and args.model)
    if args.policy == "llm" and not args.regenerate_points and not named:
        say.error("--policy llm needs --endpoint-file FILE, or --base-url URL and --model NAME")
        return 2
    args.outdir.mkdir(parents=True, exist_ok=True)
    try:
        doc = evaluate(args)
    except (PolicyUnavailable, InfrastructureError, OSError) as e:
        say.error(f"{e}")
        return 1
    if args.regenerate_points:
        say.note(f"wrote {doc['points']} decision points to {doc['regenerated']}")
        return 0
    publish(args.outdir / "eval.json", orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    publish(args.outdir / "eval.html", render(doc).encode())
    score = "none" if doc["score"] is None else f"{doc['score']:.2f}"
    say.note(
        f"score {score} over {len(doc['points'])} decisions ({len(doc['wrong'])} not acceptable); "
        f"{args.outdir / 'eval.html'}"
    )
    return 0

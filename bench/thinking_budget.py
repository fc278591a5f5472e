"""Thinking bounded per step: decode tokens and seconds per agent step, with and without a budget.

A thinking model's step is its thought plus its call; once the prompt is cached, decoding the
thought is most of the step. vLLM's per-request ``thinking_token_budget`` (what ``agent run
--thinking-budget`` and the family's catalogue ``thinking_budget`` send) closes the thought at the
budget, and the model goes on to its call. This runs the same agent request (the real
instructions and tool schemas, Qwen3.5/3.6's format) against one server, both arms side by side:

  unbounded   the thought runs until the model ends it, or until max_tokens cuts the reply
  budget N    the server closes the thought after N tokens

The model is the tiny random-weight Qwen3 model (agent/testing/tiny_model.py) with the Qwen3.5
test template (its generation prompt opens the thought), served with that family's reasoning and
tool-call parsers: its thought never ends by itself (a trained
model's does, somewhere), and after the thought a structured-outputs regex makes it write one
`finish` call (its text: tool_choice none), as a trained model would. So "unbounded" is the worst case, a reply cut while
thinking at max_tokens; the figures are the server's own (vLLM per-request metrics: decode
seconds from the first token to the last) and the step's wall seconds.

    python -m bench.thinking_budget [--budget 64] [--max-tokens 512] [--steps 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.policies.llm import LLMPolicy
from agent.prompts import BRIEF
from agent.record.world_state import WorldState
from agent.testing.forced import CALLS, literal
from agent.testing.tiny_model import FAMILIES, TEMPLATES
from bench import _report, _script, _server

FAMILY = "qwen3.5"  # its generation prompt opens the thought, as Qwen3.6's does
TEMPLATE = TEMPLATES / FAMILIES[FAMILY].template
CALL = CALLS["qwen3_coder"]("finish", {"conclusion": "done"})


def step(
    server: _server.Server, messages: list[dict[str, Any]], budget: int | None, max_tokens: int
) -> dict[str, Any]:
    """One agent request through the agent's own policy (a fresh one: no recovery between
    steps, so every step of an arm asks the same); its figures. The tools are in the prompt but
    the call is the regex's text (tool_choice none): the server's own tool grammar would let the
    random model fill the arguments up to max_tokens, which no trained model does."""
    policy = LLMPolicy(
        server.base_url,
        server.endpoint.model,
        server.api_key,
        max_tokens=max_tokens,
        thinking_budget=budget,
        tool_choice="none",
        extra_body={"structured_outputs": {"regex": literal(CALL)}},
        log=io.StringIO(),  # the cut's console line is not a figure
    )
    start = time.perf_counter()
    d = policy.decide(messages, _script.tool_schemas(), WorldState(meta={}))
    wall = time.perf_counter() - start
    return {
        "completion": d.usage.completion_tokens,
        "reasoning": d.usage.reasoning_tokens or 0,
        "decode_s": d.timing.decode_seconds if d.timing else None,
        "ttft_s": d.timing.ttft_seconds if d.timing else None,
        "wall_s": wall,
        "ended": d.finish_reason == "stop",  # the call written to its end, not cut
        "cut": (d.finish_reason or "").startswith("length"),
        "hit": bool(d.thinking_budget_hit),
    }


def arm(name: str, rows: list[dict[str, Any]]) -> list[Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return [
        name,
        f"{med('completion'):.0f}",
        f"{med('reasoning'):.0f}",
        f"{med('decode_s'):.3f}",
        f"{med('completion') / med('decode_s'):.0f}",
        f"{med('ttft_s'):.3f}",
        f"{med('wall_s'):.3f}",
        f"{sum(r['ended'] for r in rows)}/{len(rows)}",
        f"{sum(r['cut'] for r in rows)}/{len(rows)}",
        f"{sum(r['hit'] for r in rows)}/{len(rows)}",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=64, help="thinking tokens per step (the arm)")
    p.add_argument("--max-tokens", type=int, default=512, help="completion limit per step")
    p.add_argument("--steps", type=int, default=5, help="requests per arm (medians shown)")
    p.add_argument("--workdir", type=Path, help="keep the model and the server's log here")
    args = p.parse_args()
    _report.header("Thinking bounded per step: decode per agent step, with and without a budget")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        model = _server.tiny_model(work)
        # the family's parsers (random_weights=False keeps the reasoning parser the budget needs)
        # and its template, on the Qwen3 architecture the CPU backend runs
        family = ("--override", f"family={FAMILY}", "--override", f"chat_template={TEMPLATE}")
        with _server.serve(
            work / "server",
            model,
            agents=1,
            random_weights=False,
            serve_args=("--enforce-eager", *family),
        ) as server:
            print(f"server ready in {server.startup_s:.0f} s", flush=True)
            context = _script.new_context(server.endpoint.max_model_len)
            context.add_user(BRIEF.format(sample="bench", input="counts.h5ad", brief=""))
            messages = context.prompt(lambda: "(no entries yet)")
            step(server, messages, args.budget, args.max_tokens)  # warm: grammar, cache
            arms = {"unbounded": None, f"budget {args.budget}": args.budget}
            results: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
            for _ in range(args.steps):  # interleaved: a drift of the machine hits both arms
                for name, budget in arms.items():
                    results[name].append(step(server, messages, budget, args.max_tokens))
    print()
    print(f"{args.steps} steps per arm, max_tokens {args.max_tokens}; medians per step")
    print(
        _report.table(
            ["arm", "decode tokens", "thinking tokens", "decode s", "tokens/s", "TTFT s",
             "step s", "call ended", "cut", "budget hit"],
            [arm(name, rows) for name, rows in results.items()],
        )
    )  # fmt: skip
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

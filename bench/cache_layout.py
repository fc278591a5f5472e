"""Cache-aware prompt layout vs naive: prefix-cache hits and prefill time over one agent session.

Both arms run the same scripted session (bench/_script.py: the real loop, instructions, tool
schemas and recorded tool results; the model is asked at every step) against one real vLLM server,
with its prefix cache emptied before each arm:

  (a) cache-aware: the project's ContextManager as it is, the rendered world state last;
  (b) naive: the same messages with the world state inside the first system message, which the
      chat template renders before the tool schemas, so every step changes the prefix early.

Reported per arm: the share of prompt tokens the server served from its prefix cache after the
first request (usage cached_tokens), the tokens it had to prefill, and the prefill seconds (the
server's own vllm:request_prefill_time_seconds) and request seconds (the agent's). Goal: (a)
serves at least 90% from cache.

    python bench/cache_layout.py [--iterations 80] [--max-model-len 16384] [--model DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import _report
import _script
import _server

from agent.context import ContextManager, Message

GOAL = 0.90
PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"


class NaiveContext(ContextManager):
    """The world state inside the first system message: what the project's layout avoids."""

    def prompt(self, world_text: str) -> list[Message]:
        *messages, world = super().prompt(world_text)
        messages[0] = {"role": "system", "content": f"{self.system_prompt}\n\n{world['content']}"}
        return messages


ARMS: dict[str, type[ContextManager]] = {
    "(a) cache-aware": ContextManager,
    "(b) naive": NaiveContext,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=80, help="agent steps per arm")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per step")
    p.add_argument("--workdir", type=Path, help="keep the server log and metrics here")
    _server.add_arguments(p)
    _script.add_arguments(p)
    args = p.parse_args()
    _report.header("Cache-aware prompt layout vs naive (prefix cache)")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        entries = _script.load_record(args, work, args.iterations)
        with _server.serve_from_args(args, work / "server", agents=1) as server:
            limit = server.endpoint.max_model_len
            print(f"server ready in {server.startup_s:.0f} s; context {limit} tokens", flush=True)
            server.warm_up(_script.tool_schemas())
            rows, figures = [], {}
            for name, kind in ARMS.items():
                server.reset_prefix_cache()
                before = server.metrics()[PREFILL_SECONDS]
                run = _script.run_session(
                    server.policy(args.max_tokens),
                    entries,
                    _script.new_context(limit, kind),
                    work / name.split()[1],
                )
                prefill_s = server.metrics()[PREFILL_SECONDS] - before
                prompt = run.total("prompt_tokens", skip_first=True)
                cached = run.total("cached_tokens", skip_first=True)
                computed = run.total("prompt_tokens") - run.total("cached_tokens")
                request_s = sum(r["decide_seconds"] for r in run.rows)
                figures[name] = (cached / prompt, computed, prefill_s, request_s)
                rows.append([
                    name, len(run.rows), f"{run.total('prompt_tokens'):,}", f"{cached / prompt:.1%}",
                    f"{computed:,}", f"{prefill_s:.1f}", f"{request_s:.1f}", run.context.truncations,
                ])  # fmt: skip
                print(f"{name}: done ({run.status}, {run.seconds:.0f} s)", flush=True)
    (a_share, a_tokens, a_prefill, a_req), (_, b_tokens, b_prefill, b_req) = figures.values()
    rows.append([
        "naive / cache-aware", "", "", "", _report.ratio(b_tokens, a_tokens),
        _report.ratio(b_prefill, a_prefill), _report.ratio(b_req, a_req), "",
    ])  # fmt: skip
    print()
    print(
        _report.table(
            ["layout", "requests", "prompt tokens", "cached after 1st", "prefilled tokens",
             "prefill s (server)", "request s (agent)", "truncations"],
            rows,
        )
    )  # fmt: skip
    verdict = "met" if a_share >= GOAL else "NOT met"
    print(f"\ngoal: (a) serves >= {GOAL:.0%} of prompt tokens from cache after the first request:"
          f" {verdict} ({a_share:.1%})")  # fmt: skip
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

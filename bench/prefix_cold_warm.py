"""Prefix cache cold vs warm: time to first token for an agent prefix as large as the context allows.

The prefix is an agent's prompt late in a session: the real instructions and tool schemas, a
history of recorded tool calls and results (bench/_script.py) and the rendered world state,
grown until it fills the server's context (counted with the server's own /tokenize). Each repeat
empties the prefix cache, streams one request (cold: the whole prefix is prefilled), then sends
the identical request again (warm: served from the cache). Reported: median time to the first
streamed token of each, their ratio, and the reference figures of issue 8 beside them.

    python -m bench.prefix_cold_warm [--max-model-len 32768] [--repeats 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import orjson

from agent.endpoint import http_json, root_url
from agent.prompts import BRIEF, SYSTEM_PROMPT
from agent.record.world_state import WorldState
from bench import _report, _script, _server

# issue 8: a 36K-token agent prefix, cold and warm, on data-centre GPUs
REFERENCE = (("A100 (issue 8)", 36_000, 11_470, 706), ("H100 (issue 8)", 36_000, 2_655, 249))
REPLY_TOKENS = 1
HISTORY_STEPS = 400  # more recorded steps than any context holds


def count_tokens(server: _server.Server, messages: list[dict], tools: list[dict]) -> int:
    status, body = http_json(
        "POST",
        root_url(server.base_url) + "/tokenize",
        server.api_key,
        {"model": server.endpoint.model, "messages": messages, "tools": tools},
        timeout_s=60,
    )
    if status != 200:
        raise RuntimeError(f"/tokenize answered {status}: {str(body)[:300]}")
    return int(body["count"])


def agent_prefix(
    server: _server.Server, entries: list[Any], tools: list[dict], target: int
) -> tuple[list[dict], int]:
    """Instructions, brief, as many recorded steps as fit under ``target`` tokens, world state."""
    head = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": BRIEF.format(sample="bench", input="counts.h5ad", brief="")},
    ]
    history: list[dict] = []
    world = WorldState(entries=[])
    best: tuple[list[dict], int] | None = None
    for step, e in enumerate(entries, 1):
        call_id = f"call-{step}"
        call = {"id": call_id, "type": "function",
                "function": {"name": e.tool, "arguments": _script.call_arguments(e)}}  # fmt: skip
        result = e.result if e.status == "ok" else {"error": e.error}
        history += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "name": e.tool,
             "content": orjson.dumps(result).decode()},
        ]  # fmt: skip
        world.entries.append(e)
        messages = [*head, *history, {"role": "user", "content": world.render()}]
        n = count_tokens(server, messages, tools)
        if n > target:
            break
        best = (messages, n)
    if best is None:
        raise RuntimeError(f"the instructions and tool schemas alone exceed {target} tokens")
    return best


def first_token_seconds(
    client: openai.OpenAI, model: str, messages: list[dict], tools: list[dict]
) -> tuple[float, int | None]:
    """Seconds to the first streamed chunk that carries output, and the cached prompt tokens."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=tools,
        max_tokens=REPLY_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    first, cached = None, None
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - start
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    if first is None:
        raise RuntimeError("the stream ended without a chunk of output")
    return first, cached


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="cold/warm pairs (median reported)")
    p.add_argument("--workdir", type=Path, help="keep the server log here")
    _server.add_arguments(p)
    _script.add_arguments(p)
    args = p.parse_args()
    _report.header("Prefix cache: time to first token, cold vs warm")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        entries = _script.load_record(args, work, HISTORY_STEPS)
        tools = _script.tool_schemas()
        with _server.serve_from_args(args, work / "server", agents=1) as server:
            limit = server.endpoint.max_model_len
            print(f"server ready in {server.startup_s:.0f} s; context {limit} tokens", flush=True)
            server.warm_up(tools)
            messages, n_tokens = agent_prefix(server, entries, tools, limit - REPLY_TOKENS - 16)
            client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key)
            cold, warm, warm_cached = [], [], []
            for i in range(args.repeats):
                server.reset_prefix_cache()
                seconds, cached = first_token_seconds(
                    client, server.endpoint.model, messages, tools
                )
                cold.append(seconds)
                seconds, cached = first_token_seconds(
                    client, server.endpoint.model, messages, tools
                )
                warm.append(seconds)
                warm_cached.append(cached or 0)
                print(f"repeat {i + 1}: cold {cold[-1] * 1000:.0f} ms, warm {warm[-1] * 1000:.0f} ms"
                      f" ({cached} of {n_tokens} tokens cached)", flush=True)  # fmt: skip
    cold_ms, warm_ms = statistics.median(cold) * 1000, statistics.median(warm) * 1000
    model = Path(args.model).name if args.model else "tiny test model"
    rows = [[f"this machine, {model}",
             f"{n_tokens:,}", f"{cold_ms:,.0f}", f"{warm_ms:,.0f}", _report.ratio(cold_ms, warm_ms),
             f"{min(warm_cached) / n_tokens:.1%}"]]  # fmt: skip
    rows += [
        [name, f"{n:,}", f"{c:,}", f"{w:,}", _report.ratio(c, w), ""] for name, n, c, w in REFERENCE
    ]
    print()
    print(
        _report.table(
            ["where", "prefix tokens", f"cold TTFT ms (median of {args.repeats})", "warm TTFT ms",
             "cold / warm", "warm: cached"],
            rows,
        )
    )  # fmt: skip
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

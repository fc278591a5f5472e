"""Loop overhead: the project's own per-iteration cost against the time of the tool calls.

A 120-step session whose tool results reach 200 KB runs through the real loop with a decider that
costs nothing and a tool that only builds its result, so the measured time per iteration is the
loop's own (world-state rendering and saving, token estimate, budget, truncation, serialisation,
metrics). The tool time it is compared with comes from a real reference analysis of a demo sample.

    python bench/loop_overhead.py [--steps 120] [--max-result-kb 200]
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated

from pydantic import Field

from agent.context import ContextManager
from agent.layout import SampleLayout
from agent.loop import run_loop
from agent.policies.base import Decision, ToolCall
from agent.registry import ToolRegistry, tool
from agent.world_state import WorldState


class NullSession:
    def __init__(self):
        self.done: set[str] = set()

    def digest(self) -> str:
        return "0" * 32

    def after_step(self, step: int, tool: str, spec: object) -> None:
        return None


@tool("markers", mutates=False)
def big_result(session: NullSession, kb: Annotated[int, Field(ge=0, le=1024)] = 1) -> dict:
    """Return a result of about `kb` kilobytes."""
    return {
        "table": [{"gene": f"G{i}", "score": i * 0.5} for i in range(kb * 1024 // 28)],
        "kb": kb,
    }


@tool("finish", mutates=False)
def finish(session: NullSession) -> dict:
    """Stop."""
    return {"done": True}


class Sizes:
    def __init__(self, steps: int, max_kb: int):
        rng = random.Random(0)
        self.sizes = [rng.choice([1, 2, 5, 20, max_kb]) for _ in range(steps - 1)]

    def decide(self, messages, tools, world) -> Decision:
        if not self.sizes:
            return Decision([ToolCall("end", "finish", "{}")])
        return Decision(
            [ToolCall(f"c{world.next_step}", "big_result", f'{{"kb": {self.sizes.pop()}}}')]
        )


def reference_tool_seconds(workdir: Path) -> float | None:
    """Mean seconds per tool call of the reference analysis of the first demo sample."""
    import subprocess
    import sys

    data = workdir / "demo"
    subprocess.run(
        [sys.executable, "-m", "agent", "synth", "--outdir", str(data), "--cohort"],
        check=True,
        capture_output=True,
    )
    sample = sorted(p for p in data.iterdir() if p.is_dir())[0]
    out = workdir / "ref"
    subprocess.run(
        [sys.executable, "-m", "agent", "run", "--input", str(sample), "--outdir", str(out)],
        check=True,
        capture_output=True,
    )
    world = WorldState.load(SampleLayout(out).record)
    return statistics.mean(e.seconds for e in world.entries)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--max-result-kb", type=int, default=200)
    p.add_argument("--context-limit", type=int, default=32768)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        registry = ToolRegistry([big_result, finish])
        world = WorldState(meta={"sample": "bench"})
        ctx = ContextManager("instructions " * 200, registry.schemas(), args.context_limit)
        ctx.add_user("analyse the sample")
        t0 = time.perf_counter()
        run_loop(
            Sizes(args.steps, args.max_result_kb),
            registry,
            NullSession(),
            world,
            ctx,
            SampleLayout(tmpdir),
            max_steps=args.steps + 1,
            log=io.StringIO(),
        )
        wall = time.perf_counter() - t0
        tool = sum(e.seconds for e in world.entries)
        per_iter = (wall - tool) / len(world.entries)
        ref = reference_tool_seconds(tmpdir)
    print(f"steps                          {len(world.entries)}")
    print(f"truncations                    {ctx.truncations}")
    print(f"loop overhead per iteration    {per_iter * 1000:.2f} ms")
    print(f"mean reference tool call       {ref * 1000:.1f} ms")
    print(f"overhead / tool time           {per_iter / ref:.2%}")


if __name__ == "__main__":
    main()

"""Loop overhead: the project's own per-iteration cost against the time of the tool calls.

A 600-step session whose tool results reach 200 KB runs through the real loop with a decider that
costs nothing and a tool that builds its result and then waits ``--tool-ms`` (a tool's time, during
which the record's background folder fsyncs may finish, as they do behind a real tool), so what an
iteration takes beyond its tool and decide time is the loop's own: prompt, world-state line and
rendering at cuts, token estimate, truncation, serialisation, the record's save and the metrics
row. Each arm times every iteration (the metrics rows' clock) and prints the mean over the ten
steps up to 50, 120, 300 and 600: flat when the loop is O(1) per step.

Arms: a quiet disk; a concurrent writer (another process writing 8 MiB blocks as fast as the disk
takes them, in the same folder, as other jobs do on a shared node; ``--writer-fsync``: each block
fsynced, a harsher neighbour); and the same writer with the record's folder fsyncs made inline, as
every save did before (the file's fsync is inline in all arms). The tool
time it is compared with is the mean call of a real reference analysis of a demo sample
(``--tool-seconds`` gives it instead).

    python -m bench.loop_overhead [--steps 600] [--max-result-kb 200] [--tool-ms 50]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import orjson
from pydantic import Field

from agent.context import ContextManager
from agent.loop import run_loop
from agent.policies.base import Decision, ToolCall
from agent.record.durable import RecordWriter
from agent.record.layout import SampleLayout
from agent.record.world_state import WorldState
from agent.registry import ToolRegistry, tool
from agent.testing.null_session import NullSession
from bench import _report

GOAL = 0.01  # of the mean tool call
MARKS = (50, 120, 300, 600)
WINDOW = 10  # steps averaged at each mark
TOOL_SECONDS = 0.05  # set by --tool-ms


@tool("markers", mutates=False)
def big_result(session: NullSession, kb: Annotated[int, Field(ge=0, le=1024)] = 1) -> dict:
    """Return a result of about `kb` kilobytes."""
    result = {"table": [{"gene": f"G{i}", "score": i * 0.5} for i in range(kb * 1024 // 28)]}
    time.sleep(TOOL_SECONDS)
    return {**result, "kb": kb}


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


def _write_forever(folder: str, fsync: bool) -> None:
    """Another job's writes, as fast as the disk takes them: 8 MiB blocks into a file of at most
    256 MiB, left to the kernel's writeback as a job writing its results does (or, ``fsync``,
    each one fsynced)."""
    block = os.urandom(8 << 20)
    with open(Path(folder) / "other-job.bin", "wb") as f:
        while True:
            for _ in range(32):
                f.write(block)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            f.seek(0)


@contextlib.contextmanager
def concurrent_writer(folder: Path, on: bool, fsync: bool) -> Iterator[None]:
    if not on:
        yield
        return
    proc = multiprocessing.get_context("spawn").Process(
        target=_write_forever, args=(str(folder), fsync)
    )
    proc.start()
    try:
        time.sleep(1.0)  # its writes under way before the first step
        yield
    finally:
        proc.terminate()
        proc.join()


@contextlib.contextmanager
def inline_folder_fsyncs(on: bool) -> Iterator[None]:
    """Every save syncs the folders before it returns, as all saves did before (the arm before)."""
    if not on:
        yield
        return
    original = RecordWriter._sync_folders

    def inline(self: RecordWriter, background: bool) -> None:
        original(self, background=False)

    RecordWriter._sync_folders = inline  # type: ignore[method-assign]
    try:
        yield
    finally:
        RecordWriter._sync_folders = original  # type: ignore[method-assign]


def session(folder: Path, steps: int, max_kb: int, limit: int) -> tuple[list[float], int]:
    """Per-iteration loop overhead in seconds (iteration time - tool - decide), and the cuts."""
    registry = ToolRegistry([big_result, finish])
    world = WorldState(meta={"sample": "bench"})
    ctx = ContextManager("instructions " * 200, registry.schemas(), limit)
    ctx.add_user("analyse the sample")
    layout = SampleLayout(folder)
    start = time.time()
    run_loop(
        Sizes(steps, max_kb), registry, NullSession(), world, ctx, layout,
        max_steps=steps + 1, log=io.StringIO(),
    )  # fmt: skip
    rows = [orjson.loads(x) for x in layout.metrics.read_bytes().splitlines()]
    ends = [start, *(r["time"] for r in rows)]
    overhead = [
        (end - begin) - r["tool_seconds"] - r["decide_seconds"]
        for begin, end, r in zip(ends, ends[1:], rows, strict=False)
    ]
    return overhead, ctx.truncations


def reference_tool_seconds(workdir: Path) -> float:
    """Mean seconds per tool call of the reference analysis of the first demo sample."""
    import subprocess

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


ARMS = {  # name: (concurrent writer, inline folder fsyncs)
    "quiet disk": (False, False),
    "concurrent writer": (True, False),
    "concurrent writer, inline fsyncs (before)": (True, True),
}


def main() -> None:
    global TOOL_SECONDS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=max(MARKS))
    p.add_argument("--max-result-kb", type=int, default=200)
    p.add_argument("--context-limit", type=int, default=32768)
    p.add_argument("--tool-ms", type=float, default=50.0, help="each tool call's wait (ms)")
    p.add_argument("--tool-seconds", type=float, help="mean tool call to compare with (default:"
                   " a reference analysis of a demo sample, about a minute)")  # fmt: skip
    p.add_argument("--writer-fsync", action="store_true", help="the writer fsyncs every block")
    p.add_argument(
        "--dir", type=Path, help="folder on the disk to measure (default: a temporary one)"
    )
    args = p.parse_args()
    TOOL_SECONDS = args.tool_ms / 1000
    _report.header("Loop overhead per iteration")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmpdir = Path(tmp)
        ref = args.tool_seconds or reference_tool_seconds(tmpdir / "reference")
        marks = [m for m in MARKS if m <= args.steps]
        rows = []
        for name, (writer, inline) in ARMS.items():
            folder = tmpdir / name.split()[0] / name.split()[-1]
            folder.mkdir(parents=True)
            with concurrent_writer(tmpdir, writer, args.writer_fsync), inline_folder_fsyncs(inline):
                overhead, cuts = session(folder, args.steps, args.max_result_kb, args.context_limit)
            at = [statistics.mean(overhead[max(m - WINDOW, 0) : m]) for m in marks]
            mean = statistics.mean(overhead)
            rows.append([name, *(f"{x * 1000:.2f}" for x in at), f"{mean * 1000:.2f}",
                         f"{mean / ref:.2%}", cuts])  # fmt: skip
            print(f"{name}: done", flush=True)
    print()
    print(
        _report.table(
            ["arm", *(f"ms/step at {m}" for m in marks), "mean ms", "of tool time", "cuts"], rows
        )
    )
    print(f"\nmean reference tool call: {ref * 1000:.0f} ms; goal: overhead under {GOAL:.0%} of it")
    print(_report.load_line("at end"))


if __name__ == "__main__":
    main()

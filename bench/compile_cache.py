"""Cohort start-up: a server that starts from an earlier server's compile cache vs a cold start.

Each shard of a cohort starts its own vLLM server. Without a shared compile cache each one
compiles the model again (torch.compile: Dynamo, then Inductor), and the cache's default folder
is under the home directory, which the nodes may not share. The workflow gives every shard one
folder (config server.cache_dir -> `agent serve --cache-dir` -> VLLM_CACHE_ROOT, where vLLM also
keeps Inductor's and Triton's caches). Three starts on CPU, torch.compile on (no
--enforce-eager), one after the other:

    cold   an empty cache folder: the first shard of a cohort
    warm   the same folder again: every later shard
    cold 2 a new empty folder, after the others: what the cache saved, not the disk's page cache

Reported: seconds from launching `python -m agent serve` to its endpoint file (the server
answers), and what vLLM logged about compiling.

    python -m bench.compile_cache [--model DIR] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from bench import _report, _server

# vLLM's own log lines (vllm/v1/engine/core.py, vllm/compilation/decorators.py and backends.py)
ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
LOADED = re.compile(r"Directly load (AOT compilation|the compiled graph)")
FAILED = re.compile(r"Compiling model again due to a load failure from \S+, reason: (.*)")
SAVED = re.compile(r"saved AOT compiled function|Compiling a graph for compile range")
ARMS = (("cold", "cache-a"), ("warm", "cache-a"), ("cold 2", "cache-b"))


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def start_once(work: Path, model: Path, cache: Path, timeout_s: float) -> dict[str, object]:
    """Start a server whose compile cache is ``cache``, then stop it; what its start cost."""
    # VLLM_CACHE_ROOT in the launcher's environment, which the server inherits: what
    # `agent serve --cache-dir` sets, without depending on that option
    os.environ["VLLM_CACHE_ROOT"] = str(cache)
    try:
        with _server.serve(work, model, agents=1, timeout_s=timeout_s) as server:
            seconds = server.startup_s
    finally:
        del os.environ["VLLM_CACHE_ROOT"]
    return {
        "seconds": seconds,
        **compile_outcome((work / "server.log").read_text("utf-8", "replace")),
    }


def compile_outcome(log: str) -> dict[str, object]:
    """What a server's log says of its start: the engine's own start-up seconds (profile,
    compile, warm-up) and whether the model was compiled, loaded from the cache, or both (a
    load that failed, then a compile)."""
    engine = ENGINE.search(log)
    failed = FAILED.search(log)
    if LOADED.search(log):
        compile = "loaded from the cache"
    elif failed:
        compile = f"load failed ({failed.group(1).strip()}), compiled"
    else:
        compile = "compiled" if SAVED.search(log) else "not compiled"
    return {"engine_s": float(engine.group(1)) if engine else None, "compile": compile}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model directory (default: the tiny test model)")
    p.add_argument("--workdir", type=Path, help="keep the caches and server logs here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one start may take")
    args = p.parse_args()
    _report.header("Cohort start-up: compile cache of an earlier server vs a cold start")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        model = args.model or _server.tiny_model(work)
        results = {}
        for arm, cache in ARMS:
            r = start_once(work / arm.replace(" ", ""), model, work / cache, args.timeout)
            r["cache_mib"] = folder_mib(work / cache)  # after this start
            results[arm] = r
            print(f"{arm}: ready in {r['seconds']:.1f} s; {r['compile']}", flush=True)
    cold, warm = results["cold"]["seconds"], results["warm"]["seconds"]
    rows = [
        [
            arm,
            cache,
            f"{r['seconds']:.1f}",
            "-" if r["engine_s"] is None else f"{r['engine_s']:.1f}",
            f"{r['cache_mib']:.1f}",
            r["compile"],
        ]
        for (arm, cache), r in zip(ARMS, results.values(), strict=True)
    ]
    print()
    name = args.model.name if args.model else "tiny test model"
    print(f"model: {name}; vLLM on CPU, torch.compile on (no --enforce-eager)")
    headers = ["start", "cache folder", "seconds to ready", "engine start s", "cache MiB", "model"]
    print(_report.table(headers, rows, left=2))
    print(f"warm start saves {cold - warm:.1f} s of {cold:.1f} s ({_report.ratio(cold, warm)})")
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

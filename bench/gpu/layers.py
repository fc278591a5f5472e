"""The four serving layers added one at a time: agent iteration latency for each, side by side.

Starts ``python -m agent serve`` once per step of the ladder, each step adding one layer to the
ones before it:

  none              --enforce-eager, no FP8, no prefix caching, no speculative decoding
  + CUDA graphs     enforce_eager=false
  + FP8             quantization=auto, kv_cache_dtype=auto (FP8 where the GPU has it)
  + prefix caching  prefix_caching=true
  + MTP             speculative=auto (MTP when the model declares MTP heads)

and runs the same agent-like session against each (bench/_script.py: the real instructions and
tool schemas as a large fixed prefix, then a history that grows by one recorded tool call and
result per step; every reply exactly --max-tokens long). A layer that changes no flag on this
machine (no GPU, no FP8 tensor cores, no MTP heads) is skipped with the flag selection's own
reason, and the next step of the ladder goes on without it. Reported per step: median and mean
iteration latency, the share of prompt tokens served from cache, and the ratio to "none".

    python bench/gpu/layers.py --model /models/Qwen3-8B [--iterations 24] [--max-tokens 64]

Without --model it serves the tiny test model (CPU smoke run: only "none" and "+ prefix caching"
apply there). See bench/gpu/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared helpers

import _report
import _script
import _server

from agent.serve import gpu as gpus
from agent.serve.flags import select_flags
from agent.serve.model_config import load_model_config

# (name, the layer in agent/serve/flags.py, the overrides that switch it on)
LADDER: list[tuple[str, str | None, dict[str, Any]]] = [
    ("none", None, {"enforce_eager": True, "quantization": "none", "kv_cache_dtype": "model",
                    "prefix_caching": False, "speculative": "off"}),
    ("+ CUDA graphs", "cuda-graphs", {"enforce_eager": False}),
    ("+ FP8", "fp8", {"quantization": "auto", "kv_cache_dtype": "auto"}),
    ("+ prefix caching", "prefix-caching", {"prefix_caching": True}),
    ("+ MTP", "speculative", {"speculative": "auto"}),
]  # fmt: skip


BASELINE = "--enforce-eager --no-enable-prefix-caching (no FP8, no speculation)"


def layer_argv(plan: Any, layer: str) -> list[str]:
    return [a for f in plan.flags if f.layer == layer for a in f.argv()]


def skip_reason(gpu: Any, plan: Any, previous: Any, layer: str) -> str | None:
    """Why switching ``layer`` on changes nothing here (the flag selection's reasons), or None.

    On CPU, leaving eager mode means torch.compile, not CUDA graphs, so that layer is skipped too.
    """
    if layer_argv(plan, layer) != layer_argv(previous, layer) and not (
        gpu.is_cpu and layer == "cuda-graphs"
    ):
        return None
    return "; ".join(f.reason for f in plan.flags if f.layer == layer)


def added(plan: Any, layer: str) -> str:
    """The arguments (and environment) a layer adds, as text."""
    parts = [
        f"{f.name}={f.value}" if f.env else " ".join(f.argv())
        for f in plan.flags
        if f.layer == layer and f.chosen
    ]
    return " ".join(parts) or "(its flags left out)"


def overrides_argv(overrides: dict[str, Any]) -> list[str]:
    out = []
    for key, value in overrides.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out += ["--override", f"{key}={text}"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the tiny test model, built here)")
    p.add_argument("--gpu", default="auto", help="auto, cpu or a preset (see `agent serve --help`)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the KV plan's)")
    p.add_argument("--iterations", type=int, default=24, help="agent steps per layer")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per step")
    p.add_argument("--workdir", type=Path, help="keep server logs and metrics here")
    _script.add_arguments(p)
    args = p.parse_args()
    _report.header("Serving layers added one at a time: agent iteration latency")
    gpu = gpus.resolve(args.gpu)
    rows: list[list[Any]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        model = Path(args.model) if args.model else _server.tiny_model(work)
        config = load_model_config(model / "config.json")
        entries = _script.load_record(args, work, args.iterations)
        print(f"model {model.name} on {gpu.label()}; {args.iterations} iterations per layer",
              flush=True)  # fmt: skip
        overrides: dict[str, Any] = {}
        previous = None
        base_ms = None
        for name, layer, switch in LADDER:
            trial = {**overrides, **switch}
            plan = select_flags(gpu, config, {**trial, "agents": 1})
            why = skip_reason(gpu, plan, previous, layer) if layer else None
            if why:
                notes.append(f"{name}: skipped: {why}")
                rows.append([name, f"skipped (note {len(notes)})", "", "", "", ""])
                print(f"{name}: skipped ({why})", flush=True)
                continue
            overrides, previous = trial, plan
            serve_args = ("--gpu", args.gpu, *overrides_argv(overrides))
            with _server.serve(
                work / f"server-{len(rows)}",
                model,
                max_model_len=args.max_model_len,
                agents=1,
                serve_args=serve_args,
            ) as server:
                print(f"{name}: server ready in {server.startup_s:.0f} s", flush=True)
                server.warm_up(_script.tool_schemas())
                run = _script.run_session(
                    server.policy(args.max_tokens),
                    entries,
                    _script.new_context(server.endpoint.max_model_len),
                    work / f"session-{len(rows)}",
                )
            latency = [r["decide_seconds"] * 1000 for r in run.rows]
            median = statistics.median(latency)
            base_ms = base_ms or median
            cached = run.total("cached_tokens") / max(1, run.total("prompt_tokens"))
            rows.append([
                name, added(plan, layer) if layer else BASELINE,
                f"{median:,.0f}", f"{statistics.mean(latency):,.0f}", f"{cached:.1%}",
                _report.ratio(base_ms, median),
            ])  # fmt: skip
            if run.status != "finished":
                print(f"{name}: the session ended {run.status}, not finished", file=sys.stderr)
    print()
    print(
        _report.table(
            ["layers", "flags added", "median ms/iter", "mean ms/iter", "cached",
             "speed-up vs none"],
            rows,
            left=2,
        )
    )  # fmt: skip
    for i, note in enumerate(notes, 1):
        print(f"note {i}: {note}")
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
reason, and the next step of the ladder goes on without it. Reported per step (the seeds'
table): median and mean iteration latency, TTFT cold (the session's first step) and warm (the
later ones' median, from the server's per-request timing), the share of prompt tokens served from
cache, MTP acceptance rate and mean accepted length, and the ratio to "none"; printed and written
to --out.

    python -m bench.gpu.layers --model Qwen/Qwen3.6-27B [--iterations 24] [--max-tokens 64]

--model is a directory or a Hub id in the Hugging Face cache (read offline, as `agent serve`).

Without --model it serves the tiny test model (CPU smoke run: only "none" and "+ prefix caching"
apply there). See bench/gpu/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.policies.llm import LLMPolicy
from agent.serve import gpu as gpus
from agent.serve import hub
from agent.serve import metrics as server_metrics
from agent.serve.flags import select_flags
from agent.serve.model_config import load_model_config
from bench import _report, _script, _server

# (name, the layer in agent/serve/flags/, the overrides that switch it on); FP8 weights are
# quantised online throughout (fp8_checkpoint false): the same checkpoint on every rung, and no
# published FP8 checkpoint needed in the cache
LADDER: list[tuple[str, str | None, dict[str, Any]]] = [
    ("none", None, {"enforce_eager": True, "quantization": "none", "kv_cache_dtype": "model",
                    "prefix_caching": False, "speculative": "off", "fp8_checkpoint": False}),
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


@dataclass
class Figures:
    """One layer's figures: what the seeds' table shows."""

    median_ms: float  # agent iteration (decide) latency
    mean_ms: float
    ttft_cold_ms: float | None  # the session's first step: its prefix was never seen
    ttft_warm_ms: float | None  # median of the later steps
    cached: float  # share of prompt tokens served from the prefix cache
    acceptance: float | None  # MTP: accepted / drafted tokens (None: no speculation)
    accepted_length: float | None  # MTP: tokens per verify step, the bonus token included
    status: str  # how the scripted session ended


def measure(
    base_url: str,
    model: str,
    api_key: str,
    max_model_len: int,
    entries: list[Any],
    max_tokens: int,
    workdir: Path,
) -> Figures:
    """One scripted agent session against a running server: iteration latency from the loop's
    metrics rows, TTFT from the server's per-request timing, MTP from its /metrics counters."""
    before = server_metrics.scrape(base_url)
    policy = LLMPolicy(
        base_url, model, api_key, max_tokens=max_tokens, extra_body={"ignore_eos": True}
    )
    run = _script.run_session(policy, entries, _script.new_context(max_model_len), workdir)
    # the session's share of the server's counters, read as the report reads them
    spec = server_metrics.figures(
        server_metrics.difference(server_metrics.scrape(base_url), before)
    )
    latency = [r["decide_seconds"] * 1000 for r in run.rows]
    ttft = [r["ttft_seconds"] * 1000 if r.get("ttft_seconds") is not None else None
            for r in run.rows]  # fmt: skip
    warm = [t for t in ttft[1:] if t is not None]
    return Figures(
        median_ms=statistics.median(latency),
        mean_ms=statistics.mean(latency),
        ttft_cold_ms=ttft[0],
        ttft_warm_ms=statistics.median(warm) if warm else None,
        cached=run.total("cached_tokens") / max(1, run.total("prompt_tokens")),
        acceptance=spec["spec_acceptance_rate"],
        accepted_length=spec["mean_accepted_length"],
        status=run.status,
    )


HEADERS = ["layers", "flags added", "median ms/iter", "mean ms/iter", "TTFT cold ms",
           "TTFT warm ms", "cached", "MTP acceptance", "MTP length", "speed-up vs none"]  # fmt: skip


def row(name: str, flags: str, f: Figures, base_ms: float) -> list[str]:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:,.0f}"

    return [
        name, flags, ms(f.median_ms), ms(f.mean_ms), ms(f.ttft_cold_ms), ms(f.ttft_warm_ms),
        f"{f.cached:.1%}", "n/a" if f.acceptance is None else f"{f.acceptance:.1%}",
        "n/a" if f.accepted_length is None else f"{f.accepted_length:.2f}",
        _report.ratio(base_ms, f.median_ms),
    ]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        help="model directory or Hub id in the Hugging Face cache (default: the tiny test model,"
        " built here)",
    )
    p.add_argument("--gpu", default="auto", help="auto, cpu or a preset (see `agent serve --help`)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the KV plan's)")
    p.add_argument("--iterations", type=int, default=24, help="agent steps per layer")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per step")
    p.add_argument("--workdir", type=Path, help="keep server logs and metrics here")
    p.add_argument(
        "--out", type=Path, default=Path("layers.md"), help="where the table is written too"
    )
    _script.add_arguments(p)
    args = p.parse_args()
    title = "Serving layers added one at a time: agent iteration latency"
    _report.header(title)
    gpu = gpus.resolve(args.gpu)
    rows: list[list[Any]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        model = args.model or str(_server.tiny_model(work))
        try:
            config = load_model_config(hub.resolve(model).path / "config.json")
        except hub.ModelNotFound as e:
            raise SystemExit(str(e)) from None
        entries = _script.load_record(args, work, args.iterations)
        print(f"model {model} on {gpu.label()}; {args.iterations} iterations per layer",
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
                rows.append([name, f"skipped (note {len(notes)})"] + [""] * (len(HEADERS) - 2))
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
                figures = measure(
                    server.base_url,
                    server.endpoint.model,
                    server.api_key,
                    server.endpoint.max_model_len,
                    entries,
                    args.max_tokens,
                    work / f"session-{len(rows)}",
                )
            base_ms = base_ms or figures.median_ms
            rows.append(row(name, added(plan, layer) if layer else BASELINE, figures, base_ms))
            if figures.status != "finished":
                print(f"{name}: the session ended {figures.status}, not finished", file=sys.stderr)
    table = _report.table(HEADERS, rows, left=2)
    text = "\n".join(
        [f"# {title}", "", f"model {model} on {gpu.label()}; {args.iterations} iterations per"
         f" layer, {args.max_tokens} tokens per reply", "", table]
        + [f"note {i}: {note}" for i, note in enumerate(notes, 1)]
    )  # fmt: skip
    print()
    print(text)
    args.out.write_text(text + "\n")
    print(f"table written to {args.out}")
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

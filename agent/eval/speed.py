"""The speed of the served model over an evaluation, from the report's own metrics code: per
request (seconds per iteration, TTFT cold and warm, prefix-cache hits, decode speed, thinking)
from rows in the loop's metrics layout (agent/report/performance.py ``sample_figures``), and the
server's counters over the evaluation (agent/serve/metrics.py: MTP acceptance and accepted
length, the server's prefix-cache hit rate and generated tokens per second)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Rows:
    """A stand-in for a report Sample: its name and metrics rows."""

    name: str
    metrics: list[dict[str, Any]] = field(default_factory=list)


def _server(args: Any) -> tuple[str, str | None] | None:
    """The server's base URL and key, for a model served over HTTP."""
    if args.policy != "llm" or args.regenerate_points:
        return None
    if args.endpoint_file is not None:
        from agent.endpoint import read_endpoint

        ep = read_endpoint(args.endpoint_file)
        return ep.url, ep.api_key
    from agent.endpoint import read_api_key

    return args.base_url, read_api_key(args.api_key_file) if args.api_key_file else None


def server_before(args: Any) -> dict[str, Any] | None:
    """The server's counters at the start (None: no server, or no /metrics)."""
    from agent.serve import metrics

    where = _server(args)
    if where is None:
        return None
    try:
        return metrics.scrape(*where)
    except OSError:
        return None


def figures(
    points: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    before: dict[str, Any] | None,
    args: Any,
    seconds: float,
) -> dict[str, Any]:
    """The speed figures: ``points``' requests (one per decision point), ``runs``' iterations
    (the end-to-end analyses' metrics rows), and the server's counters since ``before``."""
    from agent.report.performance import sample_figures
    from agent.serve import metrics

    out: dict[str, Any] = {"seconds": round(seconds, 1)}
    # the points' rows are single requests (no tool ran between them): their "iteration" is a
    # request; the first is the only one with a cold prefix (instructions and tools)
    for name, rows in (("points", points), ("end_to_end", runs)):
        found = sample_figures(Rows(name, rows))  # type: ignore[arg-type]
        out[name] = asdict(found) if found is not None else None
    where = _server(args)
    if before is not None and where is not None:
        try:
            after = metrics.scrape(*where)
        except OSError:
            after = None
        if after is not None:
            # the server's generation rate over the time it was asked, not over case building
            asking = sum(r.get("decide_seconds") or 0.0 for r in [*points, *runs]) or seconds
            server = metrics.figures(metrics.difference(after, before), asking)
            keep = ("requests", "prefix_cache_hit_rate", "spec_acceptance_rate",
                    "mean_accepted_length", "acceptance_per_position", "ttft_p50_s",
                    "decode_tokens_per_s", "generation_tokens_per_s", "preemptions")  # fmt: skip
            out["server"] = {k: server.get(k) for k in keep}
    return out

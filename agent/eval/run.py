"""One evaluation: every case walked with the model asked at each decision point, a few cases
analysed end to end by the model, and the server's speed over it all.

At a point the model gets the very request a run sends there: the runner's instructions, tools,
brief and policy settings (agent/policies make_policy: sampling, thinking budget), and the
history of the recipe's calls so far with their results, laid out and cut by the real context
manager. Its reply is judged (agent/eval/scoring.py), and the walk goes on with the recipe's own
call, so every point is asked in the state the reference analysis reached.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.config import RunConfig
from agent.eval import cases as case_builds
from agent.eval import points as decision_points
from agent.eval.scoring import judge, settle
from agent.policies.base import Decision, PromptTooLong, ToolCall
from agent.record.provenance import now, versions


@dataclass
class Asked:
    """What the model was asked and answered at the points, for the speed figures: rows in the
    loop's metrics layout (agent/loop.py), which the report's figures read."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, decision: Decision, seconds: float) -> None:
        u, t = decision.usage, decision.timing
        self.rows.append({
            "decide_seconds": round(seconds, 4), "tool_seconds": 0.0,
            "prompt_tokens": u.prompt_tokens if u else None,
            "completion_tokens": u.completion_tokens if u else None,
            "cached_tokens": u.cached_tokens if u else None,
            "reasoning_tokens": u.reasoning_tokens if u else None,
            "queue_seconds": t.queue_seconds if t else None,
            "ttft_seconds": t.ttft_seconds if t else None,
            "decode_seconds": t.decode_seconds if t else None,
            "thinking_budget_hit": decision.thinking_budget_hit,
        })  # fmt: skip


def _config(args: Any, input_path: Path, outdir: Path, sample: str, **more: Any) -> RunConfig:
    """The RunConfig a run of this sample with the evaluated model would have."""
    return RunConfig(
        input=input_path, outdir=outdir, sample=sample, policy=args.policy,
        endpoint_file=args.endpoint_file, base_url=args.base_url, model=args.model,
        api_key_file=args.api_key_file, max_tokens=args.max_tokens,
        no_thinking=args.no_thinking, thinking_budget=args.thinking_budget,
        request_timeout=args.request_timeout, seed=args.seed, **more,
    )  # fmt: skip


def walk_case(name: str, input_path: Path, folder: Path, args: Any, asked: Asked, ask: bool):
    """The points of case ``name`` and, where ``ask``, the model's verdict at each."""
    from agent.context import ContextManager, TokenCounter, tokenizer_estimate
    from agent.policies import make_policy
    from agent.prompts import BRIEF, SYSTEM_PROMPT
    from agent.record.world_state import WorldState
    from agent.tools import build_registry
    from agent.tools.session import Session

    registry = build_registry()
    session = Session(folder / "walk", seed=args.seed, input_path=input_path)
    world = WorldState(meta={"sample": name})
    walk = decision_points.Walk(name, session, world, registry)
    setup = make_policy(_config(args, input_path, folder / "run", name), registry) if ask else None
    context = None
    if setup is not None:
        context = ContextManager(
            SYSTEM_PROMPT, registry.schemas(), setup.context_limit or args.context_limit,
            completion_reserve=setup.max_tokens, history_reasoning=setup.history_reasoning,
            counter=TokenCounter(tokenizer_estimate(setup.tokenizer)),
        )  # fmt: skip
        context.add_user(BRIEF.format(sample=name, input=input_path.name, brief=""))
    defaults = registry.defaults()
    verdicts, points = [], []
    for point, call in walk.steps():
        verdict = None
        if setup is not None and context is not None:
            decision = _ask(setup.policy, context, registry, world, defaults, asked)
            verdict = judge(
                point, decision, session, registry, folder / f"point_{point.step}",
                lambda kind: decision_points.bounds_for(kind, session, walk.facts, {}),
            )  # fmt: skip
            context.add_decision(Decision([ToolCall(call.id, call.name, call.arguments)]))
        entry = walk.advance(call)
        # the checks the recipe's own call fails here are the data's: forgiven in every decision
        found = (entry.result or {}).get("checks") or []
        point = point.model_copy(
            update={"tolerated": sorted({c["rule"] for c in found if c["verdict"] != "pass"})}
        )
        points.append(point)
        if verdict is not None:
            verdicts.append({"point": point.id, "kind": point.kind, "rule": point.rule,
                             "reference": point.reference,
                             **settle(verdict, point.tolerated)})  # fmt: skip
        if context is not None:  # the recipe's result, with its line, as the loop adds it
            context.add_result(call.id, entry, world.line(entry, defaults))
    return points, verdicts


def _ask(policy, context, registry, world, defaults, asked: Asked) -> Decision:
    """One request, as the loop sends it (a prompt the server finds too long is cut harder); a
    point whose prompt cannot fit the server's context at all is answered by no call."""
    from agent.context import ContextOverflow

    for _ in range(4):
        try:
            messages = context.prompt(lambda: world.render(defaults=defaults))
        except ContextOverflow as e:
            return Decision(text=f"not asked: {e}", finish_reason="context overflow")
        t0 = time.perf_counter()
        try:
            decision = policy.decide(messages, registry.schemas(), world)
        except PromptTooLong as e:
            context.observe_overflow(e.prompt_tokens)
            continue
        asked.add(decision, time.perf_counter() - t0)
        context.observe(decision.usage)
        return decision
    return Decision(text="the prompt stayed too long for the server", finish_reason="length")


def end_to_end(name: str, input_path: Path, folder: Path, args: Any) -> dict[str, Any]:
    """The model's own analysis of a case, scored: how it ended, its checks, and its clusters
    and labels against the planted or published truth."""
    from agent.checks import worst
    from agent.record.world_state import WorldState
    from agent.runner import run_sample

    outdir = folder / "run"
    # an earlier evaluation's analysis here would be kept by the runner (same settings) or
    # refused (another model) instead of this model's being run and scored
    shutil.rmtree(outdir, ignore_errors=True)
    config = _config(args, input_path, outdir, name, max_steps=args.max_steps)
    status = run_sample(config)
    world = WorldState.load(config.layout.record)
    found = world.meta.get("checks") or []
    passed = sum(c["verdict"] == "pass" for c in found)
    out: dict[str, Any] = {
        "status": status,
        "steps": len(world.entries),
        "checks": {
            "pass": passed,
            "warn": sum(c["verdict"] == "warn" for c in found),
            "refused": sum(c["verdict"] == "refused" for c in found),
            "worst": worst(found),
        },
        "record": str(config.layout.record),
    }
    leiden = world.last_ok("leiden")
    key = (leiden.params.get("key_added") if leiden else None) or "leiden"
    truth = _truth_scores(input_path, config.layout.final, key)
    out.update(truth)
    parts = [{"finished": 1.0, "partial": 0.5}.get(status, 0.0),
             passed / len(found) if found else 0.0]  # fmt: skip
    if truth:  # the case has truth: what the object lacks of it scores 0
        parts += [out.get(k) or 0.0 for k in ("ari", "label_agreement")]
    out["score"] = round(statistics.mean(parts), 4)
    return out


def _truth_scores(input_path: Path, final: Path, key: str) -> dict[str, Any]:
    """ARI of the clusters (obs column ``key``) and label agreement, where the case has planted
    or published labels ({} where it has none; None for what the object lacks)."""
    import anndata as ad

    from agent.data.real import PUBLISHED_TYPES, per_type_agreement
    from agent.record.truth import read_truth, score

    truth_file = case_builds.truth(input_path)
    if truth_file is None:
        return {}
    if not final.is_file():
        return {"ari": None, "label_agreement": None}
    obs = ad.read_h5ad(final, backed="r").obs
    truth = read_truth(truth_file)
    scored = score(obs, truth, cluster_key=key)
    out: dict[str, Any] = {"ari": scored.get("ari"), "label_agreement": None}
    if "cell_type" in obs.columns:
        labels = obs["cell_type"].astype(str)
        known = truth.loc[truth.index.intersection(labels.index), "cell_type"].astype(str)
        if set(known) & set(PUBLISHED_TYPES):
            agreement = per_type_agreement(labels.loc[known.index], known)
            out["label_agreement"] = round(statistics.mean(agreement.values()), 4)
            out["label_agreement_by_type"] = agreement
        else:  # planted types carry the marker sets' names
            out["label_agreement"] = round(float((labels.loc[known.index] == known).mean()), 4)
    return out


def evaluate(args: Any) -> dict[str, Any]:
    """The whole evaluation; the document eval.json holds."""
    from agent.eval.speed import figures, server_before

    started, t0 = now(), time.perf_counter()
    outdir: Path = args.outdir
    names = args.cases or list(case_builds.CASES)
    kept = decision_points.read()
    asked = Asked()
    before = server_before(args)
    summary: dict[str, Any] = {}
    verdicts: list[dict[str, Any]] = []
    derived: dict[str, list[decision_points.Point]] = {}
    stale: list[str] = []
    for name in names:
        folder = outdir / "cases" / name
        path = case_builds.build(name, folder / "input")
        if path is None:
            summary[name] = {"evaluated": False, "why": "its package is not installed"}
            print(f"agent eval: {name}: left out (its package is not installed)", file=sys.stderr)
            continue
        pts, found = walk_case(name, path, folder, args, asked, ask=not args.regenerate_points)
        derived[name] = pts
        verdicts += found
        stale += decision_points.differences(pts, kept.get(name, []))
        right = sum(v["acceptable"] for v in found)
        summary[name] = {"evaluated": True, "points": len(pts), "acceptable": right}
        said = (
            f"{len(pts)} decision points"
            if args.regenerate_points
            else (f"{right}/{len(found)} decisions acceptable")
        )
        print(f"agent eval: {name}: {said}", file=sys.stderr)
    if args.regenerate_points:
        decision_points.write(derived)
        return {"regenerated": str(decision_points.POINTS_FILE),
                "points": sum(map(len, derived.values()))}  # fmt: skip
    runs = {}
    for name in args.end_to_end:  # also a case not walked (--cases): its input is built here
        path = case_builds.build(name, outdir / "cases" / name / "input")
        if path is None:
            summary.setdefault(name, {"evaluated": False, "why": "its package is not installed"})
            continue
        runs[name] = end_to_end(name, path, outdir / "end_to_end" / name, args)
        print(f"agent eval: {name} end to end: {runs[name]['status']}", file=sys.stderr)
    by_kind: dict[str, list[bool]] = {}
    for v in verdicts:
        by_kind.setdefault(v["kind"], []).append(v["acceptable"])
    e2e_rows = [row for run in runs.values() for row in _rows(run["record"])]
    kinds = {k: round(statistics.mean(v), 4) for k, v in sorted(by_kind.items())}
    return {
        "model": _model(args),
        # each kind of decision weighs alike: the many next-step points must not drown the few
        # parameter choices
        "score": round(statistics.mean(kinds.values()), 4) if kinds else None,
        "points_acceptable": round(statistics.mean(v["acceptable"] for v in verdicts), 4)
        if verdicts
        else None,
        "by_kind": kinds,
        "points": verdicts,
        "wrong": [
            f"{v['point']} ({v['kind']}): {v['why']}" for v in verdicts if not v["acceptable"]
        ],
        "cases": summary,
        "end_to_end": runs,
        "end_to_end_score": round(statistics.mean(r["score"] for r in runs.values()), 4)
        if runs
        else None,
        "speed": figures(asked.rows, e2e_rows, before, args, time.perf_counter() - t0),
        "points_file": {"path": str(decision_points.POINTS_FILE), "differences": stale},
        "started": started,
        "seconds": round(time.perf_counter() - t0, 1),
        "versions": versions(),
    }


def _rows(record: str) -> list[dict[str, Any]]:
    from agent.record.durable import read_appended_rows
    from agent.record.layout import SampleLayout

    path = SampleLayout(Path(record).parent).metrics
    return read_appended_rows(path) if path.exists() else []


def _model(args: Any) -> dict[str, Any]:
    """The model, server and GPU evaluated, as the endpoint file names them."""
    if args.policy != "llm":
        return {"policy": args.policy}
    if args.endpoint_file is None:
        return {"policy": "llm", "model": args.model, "base_url": args.base_url}
    from agent.endpoint import read_endpoint

    ep = read_endpoint(args.endpoint_file)
    info = ep.info
    return {
        "policy": "llm", "model": ep.model, "model_id": info.get("model_id"),
        "revision": info.get("revision"), "vllm_version": info.get("vllm_version"),
        "gpu": info.get("gpu"), "flags": ep.flags, "family": (info.get("family") or {}).get("name"),
        "endpoint_file": str(args.endpoint_file),
    }  # fmt: skip

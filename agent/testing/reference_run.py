"""The reference analysis of one sample without the agent loop: the registry driven by the
ReferencePolicy in a plain for-loop (what the loop does, minus prompts and budgets), for tests and
benchmarks that need an analysed sample, and one tool call as the loop makes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.policies.reference import ReferencePolicy
from agent.record.provenance import file_sha256
from agent.record.world_state import Entry, WorldState
from agent.registry import Outcome
from agent.tool_declarations import FINISH
from agent.tools import build_registry
from agent.tools.session import Session

REGISTRY = build_registry()


def call_tool(session: Session, tool: str, **args: Any) -> Outcome:
    """One tool call through the registry, as the loop makes it."""
    return REGISTRY.call(tool, args, session)


def run_reference(
    input_path: str | Path,
    outdir: str | Path,
    seed: int = 0,
    max_steps: int = 60,
    stop_after: str | None = None,
    celltypist_model: Path | None = None,
    doublets: str = "remove",
) -> tuple[Session, WorldState]:
    """The reference analysis of one sample, step by step; stops after finish (or stop_after).
    ``celltypist_model``: the run's model, as --celltypist-model gives it (meta as the runner
    writes it); ``doublets``: the run's doublets setting (--doublets)."""
    registry = REGISTRY
    session = Session(
        outdir, seed=seed, input_path=input_path, celltypist_model=celltypist_model,
        doublets=doublets,
    )  # fmt: skip
    meta = {"input": str(input_path), "doublets": doublets}
    if celltypist_model is not None:
        meta["celltypist_model_sha256"] = file_sha256(celltypist_model)
    world = WorldState(meta=meta)
    policy = ReferencePolicy(registry)
    for _ in range(max_steps):
        decision = policy.decide([], registry.schemas(), world)
        if not decision.calls:
            break
        call = decision.calls[0]
        before = session.digest()
        outcome = registry.call(call.name, call.arguments, session)
        entry = world.add(Entry(
            **vars(outcome), step=world.next_step, digest_before=before,
            digest_after=session.digest(), call_id=call.id,
        ))  # fmt: skip
        if outcome.ok:
            entry.checkpoint = session.after_step(
                entry.step, outcome.tool, registry.spec(outcome.tool)
            )
            if outcome.tool in (FINISH, stop_after):
                break
    return session, world

"""Picking up an interrupted run: its unfinished record, its data, and its metrics rows."""

from __future__ import annotations

import os
from typing import Any

from agent.layout import SampleLayout
from agent.provenance import now
from agent.registry import ToolRegistry
from agent.world_state import WorldState


def resume_point(layout: SampleLayout, input_sha256: str, fresh: bool) -> WorldState | None:
    """The unfinished record of an earlier run of this sample on the same input, if any."""
    path = layout.record_copy
    if fresh or not path.exists():
        return None
    try:
        earlier = WorldState.load(path)
    except ValueError as e:  # writes are atomic, so only outside damage does this
        raise SystemExit(
            f"cannot resume: {e}; rerun with --fresh to start this sample over"
        ) from None
    if earlier.meta.get("status") == "finished" or earlier.meta.get("input_sha256") != input_sha256:
        return None
    return earlier


def catch_up(world: WorldState, session: Any, registry: ToolRegistry) -> dict[str, Any]:
    """Bring the session to the state after the last recorded step: load the newest checkpoint
    that holds its step's recorded data (a damaged one is passed over), then re-run the recorded
    calls after it, checking each lands on its recorded digest. Returns what was done, for meta."""
    last = world.entries[-1].step if world.entries else 0
    digests = {e.step: e.digest_after for e in world.entries}
    restored, rejected = session.restore(last, digests)
    restored = restored or 0
    for e in world.entries:
        if e.step <= restored or e.status != "ok":
            continue
        out = registry.call(e.tool, e.params, session)
        if not out.ok or session.digest() != e.digest_after:
            raise RuntimeError(
                f"cannot resume: step {e.step} ({e.tool}) did not reproduce its recorded result "
                f"({out.error or 'data digest differs'}); rerun with --fresh"
            )
    done = {"at_step": world.next_step, "checkpoint_step": restored, "time": now()}
    return {**done, "rejected_checkpoints": rejected} if rejected else done


def keep_metrics(layout: SampleLayout, fresh: bool) -> None:
    """The metrics file is a declared output, which Snakemake deletes when a job fails: the loop
    appends to a hard link of a file kept beside the checkpoints, so a resumed run goes on with
    the rows of the attempts before it."""
    path, kept = layout.metrics, layout.metrics_copy
    if fresh:
        kept.unlink(missing_ok=True)
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.touch()
    path.unlink(missing_ok=True)
    os.link(kept, path)

"""What a new run of a sample does with the record an earlier run left in its folder.

- none, or ``--fresh``: a new analysis (``--fresh`` first moves the earlier one to
  ``previous/<started>/``, so nothing finished is lost);
- a record that ended with a result (finished, or stopped after repeated failures, or at a step
  limit this run does not raise) on the same input with the same settings: kept as it is;
- an unfinished record (running when killed, failed, interrupted, or stopped at a step limit this
  run raises) on the same input with the same settings: resumed from its newest usable checkpoint;
- any other input or setting: refused, naming it (redoing or mixing analyses takes ``--fresh``,
  or ``--replace-changed``, which the workflow passes: an edited sheet or input asks for it).
"""

from __future__ import annotations

import shutil
from typing import Any, Literal

from agent.durable import link_atomically, same_file
from agent.integrity import check_record
from agent.layout import SampleLayout
from agent.provenance import now
from agent.registry import ToolRegistry
from agent.world_state import WorldState, record_version

# ended with the analysis' own result (a refused input is refused again by the same settings)
RESULTS = ("finished", "repeated_failures", "input_refused")
# meta.record_version from which input_refused is the input's content only, never the job's memory
RESOURCES_ARE_FAULTS = 2

Action = Literal["new", "keep", "resume"]


class CannotReuse(Exception):
    """The folder holds a record this run must not keep, resume or overwrite unasked."""


def differences(meta: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return [
        f"{key} {meta.get(key)!r} (this run: {wanted[key]!r})"
        for key in wanted
        if meta.get(key) != wanted[key]
    ]


def refuse_other_settings(
    layout: SampleLayout, meta: dict[str, Any], wanted: dict[str, Any]
) -> None:
    differ = differences(meta, wanted)
    if differ:
        raise CannotReuse(
            f"{layout.record_copy} holds an analysis of this sample ({meta.get('status')}) made "
            f"with other settings: {'; '.join(differ)}. Rerun with the same settings to keep or "
            "resume it, or with --fresh to start over (the earlier analysis is moved to "
            f"{layout.root / 'previous'}/)"
        )


def ended_with_finish(world: WorldState) -> bool:
    """A run killed after `finish` succeeded but before its record said so is finished."""
    last = world.entries[-1] if world.entries else None
    return last is not None and last.tool == "finish" and last.status == "ok"


def plan(
    layout: SampleLayout,
    wanted: dict[str, Any],
    max_steps: int,
    fresh: bool = False,
    replace_changed: bool = False,
) -> tuple[Action, WorldState | None]:
    """What to do with the folder's earlier record (see the module's docstring);
    ``replace_changed``: start over instead of refusing other settings."""
    path = layout.record_copy
    if fresh or not path.exists():
        set_aside(layout)
        return "new", None
    try:
        earlier = WorldState.load(path)
    except ValueError as e:  # writes are atomic, so only outside damage does this
        raise CannotReuse(
            f"cannot resume: {e}; rerun with --fresh to start this sample over"
        ) from None
    problems = check_record(earlier, layout.root, final=False)
    if problems:  # never build on, or keep, a record edited since it was written
        raise CannotReuse(
            f"{path} was altered: {'; '.join(p.what for p in problems)}; rerun with --fresh to "
            "start this sample over"
        )
    if replace_changed and differences(earlier.meta, wanted):
        set_aside(layout)
        return "new", None
    refuse_other_settings(layout, earlier.meta, wanted)
    status = earlier.meta.get("status")
    if status == "input_refused" and record_version(earlier.meta) < RESOURCES_ARE_FAULTS:
        # before version 2 too little memory for the input was a refusal too: not a result to
        # keep; a refusal of the content costs a load_data to find again
        set_aside(layout)
        return "new", None
    if (
        status in RESULTS
        or ended_with_finish(earlier)
        or (status == "step_limit" and earlier.next_step > max_steps)
    ):
        return "keep", earlier
    return "resume", earlier


def set_aside(layout: SampleLayout) -> None:
    """Before a new analysis: move an earlier one's published files and record to
    ``previous/<its start time>/`` and drop its checkpoints (a new run must never restore them)."""
    publish(layout)  # whatever Snakemake deleted comes back from its copy, and goes with the rest
    found = [p for p in layout.kept_results() if p.exists()]
    if found:
        try:
            stamp = WorldState.load(layout.record_copy).meta.get("started") or now()
        except ValueError:  # a damaged record is kept too, under the time it was set aside
            stamp = now()
        target = layout.previous(stamp.replace(":", ""))
        while target.exists():
            target = target.with_name(target.name + "+")
        target.mkdir(parents=True)
        for p in found:
            shutil.move(p, target / p.name)
    for copy in layout.kept_copies().values():
        if copy.is_dir():
            shutil.rmtree(copy)
        else:
            copy.unlink(missing_ok=True)
    if layout.checkpoints.is_dir():
        for p in layout.checkpoints.iterdir():
            if SampleLayout.checkpoint_step(p) is not None:
                p.unlink()


def publish(layout: SampleLayout) -> None:
    """Keep a copy of every published file beside the checkpoints, and publish again what is
    gone: Snakemake deletes a job's declared outputs when it fails, even after the agent ended
    (an input with a modification time in the future) or when the job was another workflow's,
    refused on this folder. The very files, linked, so bytes and modification times stay those of
    the run that wrote them. The record's copy is the one the runs write (the name follows it);
    the final data and plots are written under their names (the copy follows them); metrics rows
    appended to a name that was deleted and made anew go after the copy's."""
    if layout.record_copy.exists():
        link_atomically(layout.record_copy, layout.record)
    if layout.metrics_copy.exists():
        _merge_metrics(layout)
        link_atomically(layout.metrics_copy, layout.metrics)
    plots = {
        p.name
        for folder in (layout.plots, layout.plots_copy)
        if folder.is_dir()
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".")  # hidden: a write in progress
    }
    pairs = [(layout.final, layout.final_copy)]
    pairs += [(layout.plots / n, layout.plots_copy / n) for n in sorted(plots)]
    for name, copy in pairs:
        if name.exists():
            link_atomically(name, copy)
        elif copy.exists():
            link_atomically(copy, name)


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


def _merge_metrics(layout: SampleLayout) -> None:
    """Rows the loop appended to a metrics file made anew under the name (Snakemake deleted the
    link while the run went on) go after the kept copy's; rows both hold (a folder copied without
    its hard links) are not repeated."""
    path, kept = layout.metrics, layout.metrics_copy
    if not (path.exists() and kept.exists()) or same_file(path, kept):
        return
    new, old = path.read_bytes(), kept.read_bytes()
    if not old.endswith(new):
        with open(kept, "ab") as f:
            f.write(new[len(old) :] if new.startswith(old) else new)


def keep_metrics(layout: SampleLayout, fresh: bool) -> None:
    """The metrics file is a declared output, which Snakemake deletes when a job fails: the loop
    appends to a hard link of a file kept beside the checkpoints, so a resumed run goes on with
    the rows of the attempts before it."""
    path, kept = layout.metrics, layout.metrics_copy
    if fresh:
        kept.unlink(missing_ok=True)
    else:
        _merge_metrics(layout)
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.touch()
    link_atomically(kept, path)


def remove_temporary(layout: SampleLayout) -> None:
    """Temporary files of writes a killed run left half done (hidden, next to their target); only
    called under the folder's lock, so no live writer owns them."""
    for folder in (layout.root, layout.checkpoints, layout.plots):
        for p in folder.glob(".*") if folder.is_dir() else ():
            if p.is_file() and p != layout.lock:
                p.unlink(missing_ok=True)

"""What a new run of a sample does with the record an earlier run left in its folder.

- none, or ``--fresh``: a new analysis (``--fresh`` first moves the earlier one to
  ``previous/<started>/``, so nothing finished is lost);
- a record that ended with a result (finished, or stopped after repeated failures, or at a step
  limit this run does not raise) on the same input with the same settings: kept as it is;
- an unfinished record (running when killed, failed, interrupted, or stopped at a step limit this
  run raises) on the same input with the same settings: resumed from its newest usable checkpoint;
- any other input or setting: refused, naming it (redoing or mixing analyses takes ``--fresh``,
  or ``--replace-changed``, which the workflow passes: an edited sheet or input asks for it).

``decide`` holds these rules, in order, with their reasons; ``plan`` carries its choice out.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from agent import say
from agent.record.durable import Unsupported, link_atomically, same_file
from agent.record.integrity import check_record
from agent.record.layout import Kept, SampleLayout
from agent.record.lock import FolderBusy, FolderLock
from agent.record.models import RunMeta
from agent.record.provenance import now
from agent.record.world_state import WorldState, record_version
from agent.registry import ToolRegistry
from agent.tool_declarations import FINISH, LOAD

# ended with the analysis' own result (a refused input is refused again by the same settings)
RESULTS = ("finished", "partial", "repeated_failures", "input_refused")
# meta.record_version from which input_refused is the input's content only, never the job's memory
RESOURCES_ARE_FAULTS = 2

Action = Literal["new", "keep", "resume"]


class CannotReuse(Exception):
    """The folder holds a record this run must not keep, resume or overwrite unasked."""


@dataclass(frozen=True)
class Choice:
    """What a run does with the folder's earlier record, and why. ``new``: whatever the folder
    holds is set aside in ``previous/`` first; ``refuse``: ``why`` is the whole message."""

    action: Literal["new", "keep", "resume", "refuse"]
    why: str


def decide(
    layout: SampleLayout,
    earlier: WorldState | None,
    damage: str | None,
    wanted: dict[str, Any],
    max_steps: int,
    fresh: bool = False,
    replace_changed: bool = False,
    served_model: str | None = None,
) -> Choice:
    """The rule table: the first rule that applies decides. ``earlier``: the folder's record (None:
    none, or unreadable), ``damage``: what makes it unusable (``read_earlier``), ``wanted``: this
    run's settings. ``served_model``: the model the policy's setup found, known only after a first
    call chose to resume (``refuse_another_model``)."""
    if fresh:
        return Choice("new", "--fresh: an earlier analysis is set aside")
    if damage:  # never build on, or keep, a record damaged or edited since it was written
        return Choice("refuse", f"{damage}; rerun with --fresh to start this sample over")
    if earlier is None:
        return Choice("new", "no earlier record")
    meta, status = earlier.meta, earlier.meta.get("status")
    if served_model is not None and earlier.entries and meta.get("model") is not None:
        wanted = {**wanted, "model": served_model}  # the model its steps were made by goes on
    differ = "; ".join(differences(meta, wanted))
    if differ and replace_changed:
        return Choice("new", f"--replace-changed: other settings: {differ}")
    if differ:
        return Choice(
            "refuse",
            f"{layout.record_copy} holds an analysis of this sample ({status}) made with other "
            f"settings: {differ}. Rerun with the same settings to keep or resume it, or with "
            f"--fresh to start over (the earlier analysis is moved to {layout.root / 'previous'}/)",
        )
    if status == "input_refused" and record_version(meta) < RESOURCES_ARE_FAULTS:
        # before version 2 too little memory for the input was a refusal too: not a result to
        # keep; a refusal of the content costs a load_data to find again
        return Choice("new", "input refused before record version 2: read it again")
    if status in RESULTS:
        return Choice("keep", f"ended with its result ({status})")
    if ended_with_finish(earlier):
        return Choice("keep", f"finish succeeded before the run ended ({status})")
    if status == "step_limit" and earlier.next_step > max_steps:
        return Choice("keep", f"at the step limit, which this run does not raise ({max_steps})")
    return Choice("resume", f"unfinished ({status})")


def differences(meta: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """The settings a record differs in; a setting added after it was written counts with the
    value its run had (RunMeta.since_added), so it still matches a run that keeps that value."""
    recorded = {key: meta[key] if key in meta else RunMeta.since_added(key) for key in wanted}
    return [
        f"{key} {recorded[key]!r} (this run: {wanted[key]!r})"
        for key in wanted
        if recorded[key] != wanted[key]
    ]


def ended_with_finish(world: WorldState) -> str | None:
    """How a run ended whose `finish` succeeded ("finished" or "partial", as finish said), also
    when it was killed before its record said so; None when no finish succeeded last. Calls its
    reply made after it were refused and recorded after it."""
    done = next((e for e in reversed(world.entries) if e.tool == FINISH and e.status == "ok"), None)
    if done is None or any(e.status == "ok" for e in world.entries if e.step > done.step):
        return None
    return (done.result or {}).get("status", "finished")


def read_earlier(layout: SampleLayout) -> tuple[WorldState | None, str | None]:
    """The folder's record (None: none) and what makes it unusable, if anything: unreadable
    (writes are atomic, so only outside damage does this), or altered since its run wrote it."""
    path = layout.record_copy
    if not path.exists():
        return None, None
    try:
        earlier = WorldState.load(path)
    except ValueError as e:
        return None, f"cannot resume: {e}"
    problems = check_record(earlier, layout.root, final=False)
    if problems:
        return earlier, f"{path} was altered: {'; '.join(p.what for p in problems)}"
    return earlier, None


def plan(
    layout: SampleLayout,
    wanted: dict[str, Any],
    max_steps: int,
    fresh: bool = False,
    replace_changed: bool = False,
) -> tuple[Action, WorldState | None]:
    """Carry out ``decide`` on the folder's earlier record: set it aside for a new analysis, or
    give it back to keep or resume; raises CannotReuse for a refusal."""
    earlier, damage = (None, None) if fresh else read_earlier(layout)
    choice = decide(layout, earlier, damage, wanted, max_steps, fresh, replace_changed)
    if choice.action == "refuse":
        raise CannotReuse(choice.why)
    if choice.action == "new":
        moved = set_aside(layout)
        if moved is not None:  # the user learns why an analysis was redone, and where the old is
            say.note(f"{layout.root.name}: {choice.why}; the earlier analysis is in {moved}")
        return "new", None
    return choice.action, earlier


def refuse_another_model(
    layout: SampleLayout,
    recorded: WorldState | None,
    wanted: dict[str, Any],
    max_steps: int,
    served_model: str | None,
) -> None:
    """The rule table again once the policy's setup found the served model: a resumed analysis
    goes on only with the model its steps were made by. ``recorded``: the record as it was before
    this run (None: a new analysis). Too late to start over here, so another model is refused
    even under ``--replace-changed``."""
    choice = decide(layout, recorded, None, wanted, max_steps, served_model=served_model)
    if choice.action == "refuse":
        raise CannotReuse(choice.why)


def set_aside(layout: SampleLayout) -> Path | None:
    """Before a new analysis: move an earlier one's published files and record to
    ``previous/<its start time>/`` (returned; None: nothing to move) and drop its checkpoints (a
    new run must never restore them)."""
    publish(layout)  # whatever Snakemake deleted comes back from its copy, and goes with the rest
    found = [p for p in layout.kept_results() if p.exists()]
    target = None
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
    for kept in layout.kept_copies():
        if kept.copy.is_dir():
            shutil.rmtree(kept.copy)
        else:
            kept.copy.unlink(missing_ok=True)
    if layout.checkpoints.is_dir():
        for p in layout.checkpoints.iterdir():
            if SampleLayout.checkpoint_step(p) is not None:
                p.unlink()
    return target


def publish(layout: SampleLayout) -> None:
    """Keep a copy of every published file beside the checkpoints, and publish again what is
    gone: Snakemake deletes a job's declared outputs when it fails, even after the agent ended
    (an input with a modification time in the future) or when the job was another workflow's,
    refused on this folder. The very files, linked, so bytes and modification times stay those of
    the run that wrote them. Of a name and its copy, the one the runs write is linked to the other
    (``SampleLayout.kept_copies`` says which); metrics rows appended to a name that was deleted
    and made anew go after the copy's."""
    _merge_metrics(layout)  # before the copy replaces the name
    for kept in layout.kept_copies():
        for name, copy in _pairs(kept):
            if name.exists() and not kept.written_as_copy:
                link_atomically(name, copy)
            elif copy.exists():  # the copy the runs write, or one of a name deleted
                link_atomically(copy, name)


def publish_unless_held(layout: SampleLayout) -> bool:
    """``publish`` under the folder's lock, for the workflow, which re-checks every sample's
    published files on each run whatever Snakemake then decides (it starts no job, so no agent
    publishes, when it finds nothing to do). Only an analysis that ended with its result, as a
    rerun with the same settings would keep it: a failed or unfinished one stays unpublished,
    so that Snakemake reruns its job. False, and nothing done, where nothing is missing, for
    such an analysis, and for a folder that another run holds (that run publishes)."""
    if not layout.record_copy.is_file() or not _unpublished(layout):
        return False
    try:
        with FolderLock(layout.lock):
            status = orjson.loads(layout.record_copy.read_bytes())["meta"].get("status")
            if status not in RESULTS:
                return False
            publish(layout)
    except (FolderBusy, Unsupported):  # a run holds it; or no flock, which a run refuses itself
        return False
    except (orjson.JSONDecodeError, KeyError, TypeError):  # a run will say what is wrong
        return False
    return True


def _unpublished(layout: SampleLayout) -> bool:
    """Whether a kept copy is not under its published name (gone, or another file there)."""
    return any(
        copy.exists() and not same_file(name, copy)
        for kept in layout.kept_copies()
        for name, copy in _pairs(kept)
    )


def _pairs(kept: Kept) -> list[tuple[Path, Path]]:
    """The published file and its copy; for a folder, each file in either and its copy (hidden
    ones left out: a write in progress)."""
    if not (kept.name.is_dir() or kept.copy.is_dir()):
        return [(kept.name, kept.copy)]
    names = {
        p.name
        for folder in (kept.name, kept.copy)
        if folder.is_dir()
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".")
    }
    return [(kept.name / n, kept.copy / n) for n in sorted(names)]


def catch_up(world: WorldState, session: Any, registry: ToolRegistry) -> dict[str, Any]:
    """Bring the session to the state after the last recorded step: load the newest checkpoint
    that holds its step's recorded data (a damaged one is passed over), then re-run the recorded
    calls after it, checking each lands on its recorded digest. Returns what was done, for meta."""
    last = world.entries[-1].step if world.entries else 0
    digests = {e.step: e.digest_after for e in world.entries}
    restored, rejected = session.restore(last, digests)
    restored = restored or 0
    if session.stages is None:  # a checkpoint made before stages were kept: the record says them
        session.stages, session.stale = {}, {}
        for e in world.entries:
            if e.step <= restored and e.status == "ok" and e.tool in registry.specs():
                if e.tool == LOAD:
                    session.stages, session.stale = {}, {}
                spec = registry.spec(e.tool)
                if spec.stage or spec.resets:
                    session.reached(e.tool, spec, e.params)
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
    # rows written under a name made anew are merged by publish alone: it is what puts the copy in
    # the name's place, at a run's end as before a resumed run (the runner publishes first)
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

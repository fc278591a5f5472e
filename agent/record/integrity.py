"""Whether a record is whole and as its run wrote it, and the final object the one it names.

``check_record`` finds: meta that does not read as a run's (agent/record/models.py); steps
missing or repeated; the first entry whose hash chain does not verify (altered, or an entry
before it removed); an entry whose data digest before is not the previous entry's after; meta that no longer matches its seal; and, for a finished analysis,
``adata.h5ad`` missing or not holding the data of the ``finish`` step. The chain and seal are
unkeyed hashes: they show edits made by hand or by another program, not a forger who recomputes
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from agent.record.layout import SampleLayout
from agent.record.models import RunMeta
from agent.record.world_state import WorldState, link, record_version, seal
from agent.registry import infrastructure_fault
from agent.tool_declarations import FINISH

NO_CHAIN = "record has no hash chain (made before it existed)"
CHAINED = 2  # meta.record_version from which a record must carry its chain and seal


@dataclass(frozen=True)
class Problem:
    step: int | None  # None: meta
    what: str


def unchained(world: WorldState) -> bool:
    """A record made before entries were chained and meta sealed: those cannot be checked. Its
    version says so; a newer record without them had them removed."""
    meta = world.meta
    old = record_version(meta) < CHAINED
    return old and "seal" not in meta and not any(e.chain for e in world.entries)


def check_record(world: WorldState, folder: Path, final: bool = True) -> list[Problem]:
    """The record's problems, by step (meta last); none for a record as its run left it.
    ``final=False`` leaves out the final object (``adata.h5ad``), e.g. before a resume."""
    problems = _meta(world) + _continuity(world) + _digests(world)
    if not unchained(world):
        problems += _chain(world) + _seal(world)
    if final:
        problems += _final(world, Path(folder))
    return sorted(problems, key=lambda p: (p.step is None, p.step or 0))


def _meta(world: WorldState) -> list[Problem]:
    """Meta of another shape than a run writes (a seal shows only edits of a run that ended)."""
    problem = RunMeta.problem(world.meta)
    return [Problem(None, problem)] if problem else []


def _continuity(world: WorldState) -> list[Problem]:
    problems, expected = [], 1
    for e in world.entries:
        if e.step > expected:
            gone = (
                f"step {expected} is"
                if e.step == expected + 1
                else f"steps {expected}-{e.step - 1} are"
            )
            before = (
                f"step {expected - 1} is followed by" if expected > 1 else "the record starts at"
            )
            problems.append(Problem(expected, f"{gone} missing ({before} step {e.step})"))
        elif e.step < expected:
            problems.append(
                Problem(e.step, f"step {e.step} appears again after step {expected - 1}")
            )
        expected = max(expected, e.step + 1)
    return problems


def _digests(world: WorldState) -> list[Problem]:
    """Each step starts from the data the step before left, except where a run was resumed (its
    data rebuilt from a checkpoint) or steps are missing (reported as such)."""
    resumed = {r.get("at_step") for r in world.meta.get("resumed") or []}
    return [
        Problem(
            b.step,
            f"step {b.step} ({b.tool}) starts from data {b.digest_before}, but step {a.step} "
            f"({a.tool}) left data {a.digest_after}",
        )
        for a, b in pairwise(world.entries)
        if b.step == a.step + 1 and b.step not in resumed and b.digest_before != a.digest_after
    ]


def _chain(world: WorldState) -> list[Problem]:
    previous = ""
    for e in world.entries:
        if e.chain is None:
            what = f"entry of step {e.step} ({e.tool}) has no chain: it was removed"
            return [Problem(e.step, what)]
        if e.chain != link(previous, e.to_json()):
            what = f"entry of step {e.step} ({e.tool}) was altered or an entry before it removed"
            return [Problem(e.step, what)]
        previous = e.chain
    return []


def _seal(world: WorldState) -> list[Problem]:
    meta = world.meta
    last = world.entries[-1].chain if world.entries else ""
    if "seal" not in meta:
        if meta.get("status", "running") == "running":  # a run killed while going on: no seal yet
            return []
        return [Problem(None, f"meta has no seal though the record says {meta['status']}")]
    if meta["seal"] != seal(meta, last or ""):
        return [
            Problem(None, "meta was altered or the last entry removed (the seal does not match)")
        ]
    return []


def _final(world: WorldState, folder: Path) -> list[Problem]:
    """A finished (or partial) record's final object: present, and the data of its finish step."""
    status = world.meta.get("status")
    if status not in ("finished", "partial"):
        return []
    finish = world.last_ok(FINISH)
    if finish is None:
        return [
            Problem(
                world.next_step,
                f"the record says {status} but has no successful finish: step {world.next_step} "
                "(finish) is missing",
            )
        ]
    import anndata as ad

    from agent.digest import DIGEST_VERSION, digest_adata

    path = SampleLayout(folder).final
    if not path.is_file():
        return [Problem(finish.step, f"{path} is missing (step {finish.step}, finish, wrote it)")]
    if world.meta.get("digest_version", 1) != DIGEST_VERSION:
        return []  # digests of another scheme cannot be compared
    try:
        digest = digest_adata(ad.read_h5ad(path))
    except Exception as e:  # whatever makes it unreadable is the finding, but the machine's fault
        if infrastructure_fault(e):  # (EIO, no memory) says nothing of the file: the caller's
            raise
        return [Problem(finish.step, f"{path} cannot be read ({type(e).__name__}: {e})")]
    if digest != finish.digest_after:
        return [
            Problem(
                finish.step,
                f"{path} is not the data step {finish.step} (finish) wrote: its data digest is "
                f"{digest}, the record says {finish.digest_after}",
            )
        ]
    return []

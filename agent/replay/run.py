"""Running a replay: the record checked whole and unaltered (agent/record/integrity.py), its input
and CellTypist model checked by content, the recorded successful calls re-issued in a scratch
folder through the same runner and loop as the original run (ReplayPolicy), each compared with
its recorded step (``compare``), and the replay.json document."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent.config import RunConfig
from agent.endpoint import PolicyUnavailable
from agent.record.integrity import NO_CHAIN, Problem, check_record, unchained
from agent.record.layout import SampleLayout
from agent.record.provenance import checksum, file_sha256, input_checksums, now, versions
from agent.record.world_state import WorldState
from agent.registry import InfrastructureError, infrastructure_fault
from agent.replay.compare import (
    DEFAULT_TOLERANCE,
    StepComparison,
    Tolerance,
    as_now,
    compare_step,
    step_json,
    verdict,
)

T = TypeVar("T")


class ReplayError(Exception):
    """A usage error: the --workdir given cannot be used."""


class NotReplayed(Exception):
    """The replay cannot start: the record cannot be read, or its input is missing or holds
    other data."""


class MachineFault(NotReplayed):
    """The machine failed the replay (full disk, I/O error, no memory): nothing is known about
    the record, and a rerun replays it."""

    def __init__(self, what: str, e: BaseException):
        super().__init__(
            f"{what}: {type(e).__name__}: {e} (a fault of the machine; a rerun replays)"
        )


def machine_fault(e: BaseException) -> bool:
    return isinstance(e, InfrastructureError | PolicyUnavailable) or bool(infrastructure_fault(e))


def _read(what: str, read: Callable[[Path], T], path: Path) -> T:
    """``read(path)``; a file that cannot be read is a NotReplayed, or a MachineFault where the
    machine is to blame (a rerun replays)."""
    try:
        return read(path)
    except OSError as e:
        if machine_fault(e):
            raise MachineFault(f"{what} cannot be read", e) from None
        raise NotReplayed(f"{what} cannot be read: {e}") from None


def check_model(recorded: WorldState, source: Path) -> None:
    """The run's CellTypist model, where it had one, still there with the content it had; else
    a NotReplayed (or MachineFault) saying so, before anything runs."""
    meta = recorded.meta
    if not meta.get("celltypist_model"):
        return
    path = Path(meta["celltypist_model"])
    where = f"recorded in {source}, meta.celltypist_model"
    if not path.is_file():
        raise NotReplayed(f"the CellTypist model {path} ({where}) is gone")
    sha256 = _read(f"the CellTypist model {path} ({where})", file_sha256, path)
    if sha256 != meta.get("celltypist_model_sha256"):
        raise NotReplayed(
            f"the CellTypist model {path} ({where}) is not the model the analysis used: sha256 "
            f"{sha256}, the record says {meta.get('celltypist_model_sha256')}"
        )


def check_input(recorded: WorldState, source: Path, given: str | Path | None = None) -> Path:
    """The input to replay on (``given``, else meta.input), holding the very data the analysis
    read (by content, not location), or a NotReplayed saying what is missing or differs."""
    meta = recorded.meta
    if not meta.get("input") or not meta.get("input_sha256"):
        raise NotReplayed(f"{source}: meta.input and meta.input_sha256 are required to replay")
    path = Path(given or meta["input"])
    where = "given with --input" if given else f"recorded in {source}, meta.input"
    if not path.exists():
        raise NotReplayed(
            f"input {path} ({where}) does not exist; replay needs the very data the analysis "
            "read (give its new place with --input)"
        )
    sums = _read(f"input {path} ({where})", input_checksums, path)
    if checksum(path, sums) == meta["input_sha256"]:
        return path
    files = meta.get("input_files")
    if files and path.is_dir():
        differ = [f"{n} differs" for n in files if n in sums and sums[n] != files[n]]
        differ += [f"{n} is missing" for n in files if n not in sums]
        differ += [f"{n} was not read by the analysis" for n in sums if n not in files]
        detail = ", ".join(differ)
    else:
        detail = f"sha256 {checksum(path, sums)}, but {source} recorded {meta['input_sha256']}"
    raise NotReplayed(f"input {path} ({where}) is not the data the analysis read: {detail}")


def _load(source: Path) -> WorldState:
    try:
        return WorldState.load(source)
    except ValueError as e:
        if machine_fault(e):
            raise MachineFault(f"cannot read {source}", e) from None
        raise NotReplayed(str(e)) from None


def _scratch(workdir: str | Path | None) -> tuple[Path, bool]:
    """The scratch folder and whether to remove it afterwards (only one we made ourselves)."""
    if workdir is None:
        try:
            return Path(tempfile.mkdtemp(prefix="scagent-replay-")), True
        except OSError as e:
            raise MachineFault(f"cannot make a scratch folder in {tempfile.gettempdir()}", e) from e
    path = Path(workdir)
    if path.exists() and any(path.iterdir()):
        # never clear it ourselves: a mistyped path could be a sample's real output folder
        raise ReplayError(f"--workdir {path} is not empty; give an empty or new folder")
    path.mkdir(parents=True, exist_ok=True)
    return path, False


def _replay_config(
    recorded: WorldState, source: Path, input_path: Path, workdir: Path, n_calls: int
) -> RunConfig:
    """The run that repeats the record: same input data, sample, seed and context, in ``workdir``."""
    meta = recorded.meta
    return RunConfig(
        input=input_path,
        outdir=workdir,
        policy="replay",
        world_state=source,
        sample=str(meta.get("sample") or "replay"),
        seed=meta.get("seed", 0),
        max_steps=max(n_calls, 1),
        fresh=True,
        **({"context_limit": meta["context_limit"]} if meta.get("context_limit") else {}),
        # annotate_celltypist's default model; the record's sha256 says which content it had
        **({"celltypist_model": meta["celltypist_model"]} if meta.get("celltypist_model") else {}),
        # records made before the doublets setting removed them: the default
        **({"doublets": meta["doublets"]} if meta.get("doublets") else {}),
        # the unfiltered droplets where they still are; else remove_ambient differs, and says so
        **({"raw_input": meta["raw_input"]} if _still_there(meta.get("raw_input")) else {}),
    )


def _still_there(path: str | None) -> bool:
    return bool(path) and Path(path).exists()


def _rerun(
    recorded: WorldState, source: Path, input_path: Path, scratch: Path, tol: Tolerance
) -> tuple[str, str | None, list[StepComparison]]:
    """Re-issue the recorded successful calls in ``scratch``; (replay status, crash, comparisons)."""
    from agent.runner import run_sample

    calls = [as_now(e, recorded.meta) for e in recorded.entries if e.status == "ok"]
    problem = None
    try:
        status = run_sample(_replay_config(recorded, source, input_path, scratch, len(calls)))
    except Exception as e:  # a crash is a divergence to report, not a reason to lose it
        if machine_fault(e):  # ... unless the machine broke it: then it says nothing of the record
            raise MachineFault(f"the replay in {scratch} broke", e) from e
        status, problem = "failed", f"{type(e).__name__}: {e}"
    state_file = SampleLayout(scratch).record
    replayed = WorldState.load(state_file).entries if state_file.is_file() else []
    dirs = (source.parent.resolve(), scratch.resolve())
    relocate = (str(dirs[1]), str(dirs[0]))
    steps = [
        compare_step(
            old,
            replayed[i] if i < len(replayed) else None,
            tol,
            dirs,
            relocate,
            check_before=i == 0 or calls[i - 1].digest_after != old.digest_before,
        )
        for i, old in enumerate(calls)
    ]
    return status, problem, steps


@dataclass
class Attempt:
    """What a replay found before its verdict: the record, its integrity problems, the rerun's
    status, crash and comparisons, or why it was not replayed."""

    recorded: WorldState = field(default_factory=WorldState)
    problems: list[Problem] = field(default_factory=list)
    note: str | None = None  # the record predates the chain
    reason: str | None = None  # why it was not replayed
    fault: bool = False  # ... for a fault of the machine
    status: str | None = None
    crash: str | None = None
    steps: list[StepComparison] = field(default_factory=list)
    input_path: str | Path | None = None
    kept: Path | None = None  # the scratch folder, where the caller gave it


def replay(
    world_state: str | Path,
    workdir: str | Path | None = None,
    tol: Tolerance = DEFAULT_TOLERANCE,
    input_path: str | Path | None = None,
) -> dict[str, Any]:
    """Replay one world state; returns the replay.json document. A record that cannot be read,
    or whose input is missing or changed, gives the verdict "not replayed"; a record that fails
    its integrity check (agent/record/integrity.py) "altered at step k" ("altered": meta), whatever
    the replay found, which the document keeps."""
    from agent.digest import DIGEST_VERSION

    source = Path(world_state)
    started, t0 = now(), time.perf_counter()
    found = _attempt(source, workdir, tol, input_path)
    meta = found.recorded.meta
    digest_versions = {"recorded": meta.get("digest_version", 1), "replay": DIGEST_VERSION}
    text, step, summary = _verdict(found, digest_versions)
    return {
        "verdict": text,
        "diverged_step": step,
        "summary": summary,
        "integrity": [{"step": p.step, "what": p.what} for p in found.problems],
        "machine_fault": found.fault,
        "tolerance": tol.to_dict(),
        "world_state": str(source.resolve()),
        "sample": meta.get("sample"),
        "input": str(found.input_path) if found.input_path else meta.get("input"),
        "input_sha256": meta.get("input_sha256"),
        "digest_versions": digest_versions,
        "recorded_status": meta.get("status"),
        "replay_status": found.status,
        "replay_error": found.crash,
        "recorded_steps": len(found.recorded.entries),
        "replayed_calls": len(found.steps),
        "workdir": None if found.kept is None else str(found.kept),
        "started": started,
        "seconds": round(time.perf_counter() - t0, 3),
        "versions": {"recorded": meta.get("versions"), "replay": versions()},
        "steps": [step_json(s) for s in found.steps],
    }


def _attempt(
    source: Path, workdir: str | Path | None, tol: Tolerance, input_path: str | Path | None
) -> Attempt:
    """Check the record, its input and model, and rerun it in a scratch folder (removed after,
    unless the caller gave it); a MemoryError or NotReplayed is the attempt's ``reason``."""
    found, scratch, remove = Attempt(input_path=input_path), None, False
    try:
        try:
            scratch, remove = _scratch(workdir)
            found.kept = None if remove else scratch
            found.recorded = recorded = _load(source)
            try:
                found.problems = check_record(recorded, source.parent)
            except Exception as e:
                if machine_fault(e):  # the final object unreadable for the machine's sake
                    raise MachineFault(f"cannot check {source.parent}", e) from e
                raise
            found.note = NO_CHAIN if unchained(recorded) else None
            found.input_path = check_input(recorded, source, input_path)
            check_model(recorded, source)
            found.status, found.crash, found.steps = _rerun(
                recorded, source, found.input_path, scratch, tol
            )
        except MemoryError as e:
            found.reason = str(MachineFault("the replay ran out of memory", e))
            found.fault = True
        except NotReplayed as e:
            found.reason, found.fault = str(e), isinstance(e, MachineFault)
    finally:
        if remove:
            shutil.rmtree(scratch, ignore_errors=True)
    return found


def _verdict(found: Attempt, digest_versions: dict[str, int]) -> tuple[str, int | None, str]:
    """(verdict, step, summary) of the whole replay: the comparison's, unless it was not
    replayed, the rerun crashed after its last call, or the record is altered (which wins, and
    the summary says what the replay found too)."""
    text, step, summary = verdict(found.steps)
    if found.reason:
        text, summary = "not replayed", f"not replayed: {found.reason}"
    elif step is not None and digest_versions["recorded"] != digest_versions["replay"]:
        summary += (
            f"; the record's data digests are of digest version {digest_versions['recorded']}, "
            f"this replay's of version {digest_versions['replay']}: digests cannot match"
        )
    elif found.crash and step is None:
        # every call matched, then the run broke (e.g. writing the record)
        step = found.steps[-1].step if found.steps else None
        text = f"diverged at step {step}" if step else "diverged"
        summary = f"the replay crashed after its last call: {found.crash}"
    if found.problems:
        step = found.problems[0].step  # by step, meta last
        text = f"altered at step {step}" if step is not None else "altered"
        replay_said = summary if summary.startswith(text) else f"{text}; {summary}"
        summary = f"{'; '.join(p.what for p in found.problems)} (the replay: {replay_said})"
    if found.note:
        summary += f"; {found.note}"
    return text, step, summary

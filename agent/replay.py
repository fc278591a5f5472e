"""`python -m agent replay`: re-run a recorded analysis with no model and compare it step by step.

The record is first checked whole and unaltered (agent/integrity.py). The recorded successful
calls are then re-issued in order with their exact parameters (ReplayPolicy) through the same
runner and loop as the original run, on the same input data (checked by content, wherever it now
lies: ``--input``), in a scratch folder. Each replayed step is then compared with its recorded
counterpart: the results (every field, recursively), the parameters, and the data digests before
and after. Verdicts:

- ``reproduced``: every result field and every digest identical;
- ``within tolerance``: some numbers differ, all within ``|a - b| <= atol + rtol * |b|``
  (b = recorded); digests that differ are then settled by comparing the two steps' checkpoints
  with the same tolerance, where both exist;
- ``diverged at step k``: the first recorded step k whose replay differs beyond that;
- ``altered at step k`` (``altered`` when only meta is): the record fails its integrity check,
  whatever the comparison found (the summary says both);
- ``not replayed``: the record cannot be read, or its input is missing or holds other data;
  or the machine failed the replay (full disk, I/O error, no memory): no finding about the
  record, ``machine_fault`` true, exit 4, which the workflow's replay job does not accept, so the
  next run replays it.

The run's input is compared by content, never by name: a record of version 2 names it
``<input>`` in load_data's result, and an older record's name for it is read as that.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from agent import say
from agent.config import RunConfig
from agent.durable import atomic_write_json
from agent.integrity import CHAINED, NO_CHAIN, check_record, unchained
from agent.layout import SampleLayout
from agent.policies.base import PolicyUnavailable
from agent.provenance import checksum, file_sha256, input_checksums, now, versions
from agent.registry import InfrastructureError, infrastructure_fault
from agent.signals import Interrupted, interruptible
from agent.world_state import Entry, WorldState, record_version

RTOL = 1e-6
ATOL = 1e-9
Kind = Literal["identical", "within tolerance", "diverged"]
_RANK: dict[str, int] = {"identical": 0, "within tolerance": 1, "diverged": 2}


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


def _machine(e: BaseException) -> bool:
    return isinstance(e, InfrastructureError | PolicyUnavailable) or bool(infrastructure_fault(e))


EXIT_MACHINE = 4
T = TypeVar("T")


@dataclass
class Difference:
    field: str  # e.g. "result.n_clusters", "params.resolution", "digest_after"
    kind: Kind
    recorded: Any
    replayed: Any
    note: str | None = None


@dataclass
class StepComparison:
    step: int  # the recorded step number
    replay_step: int | None
    tool: str
    kind: Kind = "identical"
    differences: list[Difference] = field(default_factory=list)

    def add(self, diff: Difference) -> None:
        self.differences.append(diff)
        if _RANK[diff.kind] > _RANK[self.kind]:
            self.kind = diff.kind


@dataclass(frozen=True)
class Tolerance:
    rtol: float = RTOL
    atol: float = ATOL

    def close(self, recorded: float, replayed: float) -> bool:
        if math.isnan(recorded) or math.isnan(replayed):
            return math.isnan(recorded) and math.isnan(replayed)
        return abs(replayed - recorded) <= self.atol + self.rtol * abs(recorded)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def compare_values(
    recorded: Any, replayed: Any, path: str, tol: Tolerance, out: StepComparison
) -> None:
    """Walk two JSON values together; record every leaf that is not identical."""
    if _is_number(recorded) and _is_number(replayed):
        if recorded == replayed or (
            isinstance(recorded, float) and math.isnan(recorded) and math.isnan(replayed)
        ):
            return
        kind: Kind = "within tolerance" if tol.close(recorded, replayed) else "diverged"
        out.add(Difference(path, kind, recorded, replayed))
    elif isinstance(recorded, dict) and isinstance(replayed, dict):
        for key in recorded.keys() | replayed.keys():
            sub = f"{path}.{key}"
            if key not in replayed:
                out.add(Difference(sub, "diverged", recorded[key], None, "missing in the replay"))
            elif key not in recorded:
                out.add(Difference(sub, "diverged", None, replayed[key], "not in the record"))
            else:
                compare_values(recorded[key], replayed[key], sub, tol, out)
    elif isinstance(recorded, list) and isinstance(replayed, list):
        if len(recorded) != len(replayed):
            out.add(
                Difference(
                    path, "diverged", len(recorded), len(replayed), "lists of different length"
                )
            )
            return
        for i, (a, b) in enumerate(zip(recorded, replayed, strict=True)):
            compare_values(a, b, f"{path}.{i}", tol, out)
    elif recorded != replayed or type(recorded) is not type(replayed):  # true is not 1 in JSON
        out.add(Difference(path, "diverged", recorded, replayed))


def _relocate(value: Any, workdir: str, outdir: str) -> Any:
    """Paths a tool reports under the scratch folder, as they were under the sample's folder."""
    if isinstance(value, str):
        return value.replace(workdir, outdir)
    if isinstance(value, dict):
        return {k: _relocate(v, workdir, outdir) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocate(v, workdir, outdir) for v in value]
    return value


def compare_checkpoints(recorded: Path, replayed: Path, tol: Tolerance) -> str | None:
    """None when two checkpointed AnnData agree within tolerance, else what differs."""
    import anndata as ad
    import numpy as np
    from scipy import sparse

    a, b = ad.read_h5ad(recorded), ad.read_h5ad(replayed)
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    if not (a.obs_names.equals(b.obs_names) and a.var_names.equals(b.var_names)):
        return "cell or gene names differ"

    def dense(m: Any) -> np.ndarray:
        return np.asarray(m.toarray() if sparse.issparse(m) else m, dtype=float)

    arrays = [("X", a.X, b.X)]
    for store in ("obsm", "layers"):
        sa, sb = getattr(a, store), getattr(b, store)
        if set(sa.keys()) != set(sb.keys()):
            return f"{store} keys {sorted(sa.keys())} vs {sorted(sb.keys())}"
        arrays += [(f"{store}[{k}]", sa[k], sb[k]) for k in sa]
    for name, x, y in arrays:
        if not np.allclose(dense(y), dense(x), rtol=tol.rtol, atol=tol.atol, equal_nan=True):
            return f"{name} differs beyond tolerance"
    for frame in ("obs", "var"):
        fa, fb = getattr(a, frame), getattr(b, frame)
        if list(fa.columns) != list(fb.columns):
            return f"{frame} columns differ"
        for col in fa.columns:
            x, y = fa[col], fb[col]
            if x.dtype.kind in "fiu" and y.dtype.kind in "fiu":
                same = np.allclose(y, x, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
            else:
                same = x.astype(str).equals(y.astype(str))
            if not same:
                return f"{frame}[{col}] differs beyond tolerance"
    return None


def _checkpoint(folder: Path, recorded: str) -> Path:
    """A recorded checkpoint path, or its namesake in the folder's checkpoints/ (results moved)."""
    path = folder / recorded  # an absolute recorded path stays as it is
    return path if path.is_file() else SampleLayout(folder).checkpoints / Path(recorded).name


def compare_step(
    old: Entry,
    new: Entry | None,
    tol: Tolerance,
    dirs: tuple[Path, Path],
    relocate: tuple[str, str],
    check_before: bool = True,
) -> StepComparison:
    """One recorded successful step against its replay.

    ``check_before=False`` skips digest_before where it only repeats the previous step's
    digest_after (it says something new only after a recorded error step changed the data).
    """
    cmp = StepComparison(old.step, new.step if new else None, old.tool)
    if new is None:
        cmp.add(Difference("step", "diverged", old.tool, None, "the replay stopped before it"))
        return cmp
    if new.status != "ok":
        cmp.add(Difference("status", "diverged", "ok", new.status, new.error))
        return cmp
    # Parameters a newer tool version added (with their defaults) are not in the record.
    recorded_params = {k: new.params[k] for k in old.params if k in new.params}
    compare_values(old.params, recorded_params, "params", tol, cmp)
    compare_values(old.result, _relocate(new.result, *relocate), "result", tol, cmp)
    for name in ("digest_before", "digest_after") if check_before else ("digest_after",):
        a, b = getattr(old, name), getattr(new, name)
        if a == b:
            continue
        kind: Kind = "diverged"
        detail = "data digests differ; no checkpoints of this step on disk to compare numerically"
        saved = (
            (_checkpoint(dirs[0], old.checkpoint), _checkpoint(dirs[1], new.checkpoint))
            if name == "digest_after" and old.checkpoint and new.checkpoint
            else None
        )
        if saved and saved[0].is_file() and saved[1].is_file():
            why = compare_checkpoints(*saved, tol)
            kind = "within tolerance" if why is None else "diverged"
            detail = f"data digests differ; checkpoints {why or 'agree within tolerance'}"
        cmp.add(Difference(name, kind, a, b, detail))
    return cmp


def _describe(d: Difference) -> str:
    text = f"{d.field}: recorded {d.recorded!r:.80}, replayed {d.replayed!r:.80}"
    return f"{text} ({d.note})" if d.note else text


def verdict(steps: list[StepComparison]) -> tuple[str, int | None, str]:
    """(verdict, diverged step or None, one-line summary)."""
    for s in steps:
        if s.kind == "diverged":
            what = "; ".join(_describe(d) for d in s.differences if d.kind == "diverged")
            return f"diverged at step {s.step}", s.step, f"step {s.step} ({s.tool}): {what}"
    close = [(s, d) for s in steps for d in s.differences]
    if close:
        named = "; ".join(f"step {s.step} ({s.tool}) {d.field}" for s, d in close[:8])
        more = f" and {len(close) - 8} more" if len(close) > 8 else ""
        return "within tolerance", None, f"within tolerance at {named}{more}"
    return "reproduced", None, f"all {len(steps)} steps reproduced exactly"


def _read(what: str, read: Callable[[Path], T], path: Path) -> T:
    """``read(path)``; a file that cannot be read is a NotReplayed, or a MachineFault where the
    machine is to blame (a rerun replays)."""
    try:
        return read(path)
    except OSError as e:
        if _machine(e):
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
        if _machine(e):
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

    calls = [_as_now(e, recorded.meta) for e in recorded.entries if e.status == "ok"]
    problem = None
    try:
        status = run_sample(_replay_config(recorded, source, input_path, scratch, len(calls)))
    except Exception as e:  # a crash is a divergence to report, not a reason to lose it
        if _machine(e):  # ... unless the machine broke it: then it says nothing of the record
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


def _as_now(e: Entry, meta: dict[str, Any]) -> Entry:
    """A recorded step as this version records it: load_data's result in a record before
    version 2 names the run's input by its file or folder name, now ``<input>``."""
    from agent.tools.io import INPUT

    path, name = (e.result or {}).get("path"), Path(meta.get("input") or "").name
    old = record_version(meta) < CHAINED and e.tool == "load_data" and name
    if old and isinstance(path, str) and (path == name or path.startswith(f"{name}/")):
        return dataclasses.replace(e, result={**e.result, "path": INPUT + path[len(name) :]})
    return e


def replay(
    world_state: str | Path,
    workdir: str | Path | None = None,
    tol: Tolerance = Tolerance(),
    input_path: str | Path | None = None,
) -> dict[str, Any]:
    """Replay one world state; returns the replay.json document. A record that cannot be read,
    or whose input is missing or changed, gives the verdict "not replayed"; a record that fails
    its integrity check (agent/integrity.py) "altered at step k" ("altered": meta), whatever
    the replay found, which the document keeps."""
    from agent.digest import DIGEST_VERSION

    source = Path(world_state)
    started, t0 = now(), time.perf_counter()
    recorded, problems, note, reason, fault = WorldState(), [], None, None, False
    status, crash, steps, scratch, remove = None, None, [], None, False
    try:
        try:
            scratch, remove = _scratch(workdir)
            recorded = _load(source)
            try:
                problems = check_record(recorded, source.parent)
            except Exception as e:
                if _machine(e):  # the final object unreadable for the machine's sake
                    raise MachineFault(f"cannot check {source.parent}", e) from e
                raise
            note = NO_CHAIN if unchained(recorded) else None
            input_path = check_input(recorded, source, input_path)
            check_model(recorded, source)
            status, crash, steps = _rerun(recorded, source, input_path, scratch, tol)
        except MemoryError as e:
            reason, fault = str(MachineFault("the replay ran out of memory", e)), True
        except NotReplayed as e:
            reason, fault = str(e), isinstance(e, MachineFault)
    finally:
        if remove:
            shutil.rmtree(scratch, ignore_errors=True)
    meta = recorded.meta
    text, step, summary = verdict(steps)
    digest_versions = {"recorded": meta.get("digest_version", 1), "replay": DIGEST_VERSION}
    if reason:
        text, summary = "not replayed", f"not replayed: {reason}"
    elif step is not None and digest_versions["recorded"] != DIGEST_VERSION:
        summary += (
            f"; the record's data digests are of digest version {digest_versions['recorded']}, "
            f"this replay's of version {DIGEST_VERSION}: digests cannot match"
        )
    elif crash and step is None:  # every call matched, then the run broke (e.g. writing the record)
        step = steps[-1].step if steps else None
        text = f"diverged at step {step}" if step else "diverged"
        summary = f"the replay crashed after its last call: {crash}"
    if problems:
        step = problems[0].step  # by step, meta last
        text = f"altered at step {step}" if step is not None else "altered"
        replay_said = summary if summary.startswith(text) else f"{text}; {summary}"
        summary = f"{'; '.join(p.what for p in problems)} (the replay: {replay_said})"
    if note:
        summary += f"; {note}"
    return {
        "verdict": text,
        "diverged_step": step,
        "summary": summary,
        "integrity": [{"step": p.step, "what": p.what} for p in problems],
        "machine_fault": fault,
        "tolerance": {
            "rtol": tol.rtol,
            "atol": tol.atol,
            "rule": "|replayed - recorded| <= atol + rtol * |recorded|, for every number in "
            "params and results; differing data digests are settled by comparing checkpoints "
            "with the same rule where both exist, else count as diverged",
        },
        "world_state": str(source.resolve()),
        "sample": meta.get("sample"),
        "input": str(input_path) if input_path else meta.get("input"),
        "input_sha256": meta.get("input_sha256"),
        "digest_versions": digest_versions,
        "recorded_status": meta.get("status"),
        "replay_status": status,
        "replay_error": crash,
        "recorded_steps": len(recorded.entries),
        "replayed_calls": len(steps),
        "workdir": None if remove or scratch is None else str(scratch),
        "started": started,
        "seconds": round(time.perf_counter() - t0, 3),
        "versions": {"recorded": meta.get("versions"), "replay": versions()},
        "steps": [_step_json(s) for s in steps],
    }


def _step_json(s: StepComparison) -> dict[str, Any]:
    return {
        "step": s.step,
        "replay_step": s.replay_step,
        "tool": s.tool,
        "comparison": s.kind,
        "differences": [d.__dict__ for d in s.differences],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-state", required=True, help="the recorded world_state.json")
    p.add_argument("--out", help="where to write replay.json (default: beside the world state)")
    p.add_argument(
        "--input",
        help="the input to replay on, when it has moved since the analysis (default: meta.input); "
        "its content must be that of the recorded input",
    )
    p.add_argument(
        "--workdir",
        help="empty scratch folder for the replay's outputs, kept afterwards "
        "(default: a temporary folder, removed)",
    )
    p.add_argument("--rtol", type=float, default=RTOL, help="relative tolerance for numbers")
    p.add_argument("--atol", type=float, default=ATOL, help="absolute tolerance for numbers")


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 reproduced or within tolerance; 1 diverged, crashed or altered (findings,
    in replay.json); 3 not replayed (unreadable record, input missing or changed; replay.json
    says why); 4 not replayed for a fault of the machine (full disk, I/O error, no memory:
    replay.json says which, and a rerun replays); 2 usage errors (tolerances, no --world-state
    file, a non-empty --workdir), nothing written; 128+N stopped by signal N, nothing written."""
    if args.rtol < 0 or args.atol < 0:
        say.error(f"tolerances must be >= 0 (rtol={args.rtol}, atol={args.atol})")
        return 2
    if not Path(args.world_state).is_file():
        say.error(f"--world-state {args.world_state} is not a file")
        return 2
    try:
        with interruptible():  # SIGTERM: the scratch folder is removed on the way out
            doc = replay(
                args.world_state, args.workdir, Tolerance(args.rtol, args.atol), args.input
            )
    except ReplayError as e:
        say.error(str(e))
        return 2
    except Interrupted as e:
        say.error(f"{args.world_state}: {e}; nothing written")
        return e.exit_code
    out = Path(args.out) if args.out else SampleLayout(Path(args.world_state).parent).replay
    try:
        atomic_write_json(out, doc, indent=True)
    except OSError as e:
        if not _machine(e):
            raise
        say.error(f"{doc['sample']}: {doc['summary']}; cannot write {out}: {e}")
        return EXIT_MACHINE
    print(f"{doc['sample']}: {doc['verdict']} ({doc['summary']}); wrote {out}")
    if doc["machine_fault"]:
        return EXIT_MACHINE
    if doc["verdict"] == "not replayed":
        return 3
    return 1 if doc["integrity"] or doc["diverged_step"] is not None or doc["replay_error"] else 0

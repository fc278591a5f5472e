"""What differs between a recorded step and its rerun: every number within a tolerance, every
other value exactly, the data digests (settled by the checkpoints where both exist), and the
verdict over all steps (see agent/replay/__init__.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent.record.integrity import CHAINED
from agent.record.layout import SampleLayout
from agent.record.world_state import Entry, record_version

RTOL = 1e-6
ATOL = 1e-9
Kind = Literal["identical", "within tolerance", "diverged"]
_RANK: dict[str, int] = {"identical": 0, "within tolerance": 1, "diverged": 2}


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "rtol": self.rtol,
            "atol": self.atol,
            "rule": "|replayed - recorded| <= atol + rtol * |recorded|, for every number in "
            "params and results; differing data digests are settled by comparing checkpoints "
            "with the same rule where both exist, else count as diverged",
        }


DEFAULT_TOLERANCE = Tolerance()


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


def as_now(e: Entry, meta: dict[str, Any]) -> Entry:
    """A recorded step as this version records it: load_data's result in a record before
    version 2 names the run's input by its file or folder name, now ``<input>``."""
    from agent.tools.io import INPUT

    path, name = (e.result or {}).get("path"), Path(meta.get("input") or "").name
    old = record_version(meta) < CHAINED and e.tool == "load_data" and name
    if old and isinstance(path, str) and (path == name or path.startswith(f"{name}/")):
        return dataclasses.replace(e, result={**e.result, "path": INPUT + path[len(name) :]})
    return e


def step_json(s: StepComparison) -> dict[str, Any]:
    return {
        "step": s.step,
        "replay_step": s.replay_step,
        "tool": s.tool,
        "comparison": s.kind,
        "differences": [d.__dict__ for d in s.differences],
    }

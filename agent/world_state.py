"""The world state: the exact record of every finished tool call, and its prompt rendering.

The artifact (world_state.json) keeps every entry whole. The rendering for the prompt is never
truncated by the context manager; it stays small by compacting older entries instead: recent
calls in full, older ones one line per tool (latest call, how many times), older errors counted.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

SCHEMA_VERSION = 1
_OPTS = orjson.OPT_SERIALIZE_NUMPY
_UMASK = os.umask(0o022)
os.umask(_UMASK)
# The record sits beside the results and, as a copy, beside the checkpoints: Snakemake deletes the
# declared outputs of a failed job, so a resumed job reads the copy that it does not own.
RECORD_NAMES = ("world_state.json", "checkpoints/world_state.json")


@dataclass
class Entry:
    step: int
    tool: str
    params: dict[str, Any]
    status: Literal["ok", "error"]
    result: dict[str, Any] | None
    error: str | None
    seconds: float
    digest_before: str | None
    digest_after: str | None
    call_id: str | None = None
    checkpoint: str | None = None


def atomic_write(path: str | Path, data: bytes | list[bytes]) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; a result file is as readable as any
        with os.fdopen(fd, "wb") as f:
            f.writelines([data] if isinstance(data, bytes) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _short(value: Any, width: int) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, str):
        text = value
    else:
        text = orjson.dumps(value).decode()
    return text if len(text) <= width else text[: width - 1] + "…"


def _kv(d: dict[str, Any] | None, width: int, numbers_only: bool = False, limit: int = 99) -> str:
    items = []
    for k, v in (d or {}).items():
        if numbers_only and (isinstance(v, bool) or not isinstance(v, int | float)):
            continue
        items.append(f"{k}={_short(v, width)}")
    return ", ".join(items[:limit])


@dataclass
class WorldState:
    meta: dict[str, Any] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    _encoded: list[bytes] = field(default_factory=list, repr=False, compare=False)

    @property
    def next_step(self) -> int:
        return self.entries[-1].step + 1 if self.entries else 1

    def add(self, entry: Entry) -> Entry:
        self.entries.append(entry)
        return entry

    def last_ok(self, tool: str) -> Entry | None:
        return next(
            (e for e in reversed(self.entries) if e.tool == tool and e.status == "ok"), None
        )

    def render(self, recent: int = 3, defaults: dict[str, dict[str, Any]] | None = None) -> str:
        """Compact text for the prompt. `defaults` (per tool) hides parameters left at default.

        The latest calls appear whole (results cut at a few hundred characters); older ones one
        line per tool (its latest successful call, its numbers, how many calls), older errors
        as a list of steps: under 1,000 tokens for a 60-step analysis.
        """
        defaults = defaults or {}

        def params(e: Entry) -> str:
            left_out = defaults.get(e.tool, {})
            shown = {k: v for k, v in e.params.items() if left_out.get(k, object()) != v}
            return _kv(shown, 16)

        cut = max(len(self.entries) - recent, 0)
        old, new = self.entries[:cut], self.entries[cut:]
        lines = [f"WORLD STATE: {len(self.entries)} tool calls done (authoritative record)."]
        latest: dict[str, tuple[Entry, int]] = {}
        for e in old:
            if e.status == "ok":
                latest[e.tool] = (e, latest.get(e.tool, (e, 0))[1] + 1)
        if latest:
            lines.append("Earlier (latest successful call per tool):")
        for e, n in sorted(latest.values(), key=lambda t: t[0].step):
            times = f" x{n}" if n > 1 else ""
            numbers = _kv(e.result, 10, numbers_only=True, limit=4)
            lines.append(f"#{e.step} {e.tool}({params(e)}){times} -> {numbers}"[:120])
        errors = [str(e.step) for e in old if e.status == "error"]
        if errors:
            lines.append(f"Earlier errors at steps {', '.join(errors[-8:])} (see record).")
        if new:
            lines.append("Latest:")
        for e in new:
            outcome = _kv(e.result, 40)[:240] if e.status == "ok" else f"ERROR {e.error}"[:240]
            lines.append(f"#{e.step} {e.tool}({params(e)}) -> {outcome}")
        return "\n".join(lines)

    def _chunks(self) -> list[bytes]:
        """The whole record as JSON. Entries are final once saved, so their encoding is kept and
        a save costs the new entries plus a join, not the whole history again (results can be
        hundreds of KB each)."""
        while len(self._encoded) < len(self.entries):
            self._encoded.append(orjson.dumps(self.entries[len(self._encoded)], option=_OPTS))
        head = orjson.dumps({"schema_version": SCHEMA_VERSION, "meta": self.meta}, option=_OPTS)
        chunks = [head[:-1], b',"entries":[']
        for i, e in enumerate(self._encoded):
            chunks += [b",", e] if i else [e]
        return [*chunks, b"]}"]

    def to_json(self) -> bytes:
        return b"".join(self._chunks())

    def save(self, path: str | Path) -> None:
        atomic_write(path, self._chunks())

    def save_record(self, outdir: Path) -> None:
        """Write the record and its copy: one write, the copy a hard link swapped in atomically."""
        first, *copies = (outdir / name for name in RECORD_NAMES)
        self.save(first)
        for copy in copies:
            copy.parent.mkdir(parents=True, exist_ok=True)
            tmp = copy.with_name(f".{copy.name}.link")
            tmp.unlink(missing_ok=True)
            os.link(first, tmp)
            os.replace(tmp, copy)

    @classmethod
    def load(cls, path: str | Path) -> WorldState:
        try:
            doc = orjson.loads(Path(path).read_bytes())
            return cls(meta=doc["meta"], entries=[Entry(**e) for e in doc["entries"]])
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a readable world state ({type(e).__name__}: {e})") from e

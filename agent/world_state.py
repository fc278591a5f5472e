"""The world state: the exact record of every finished tool call, and its prompt rendering.

The artifact (world_state.json) keeps every entry whole. The rendering for the prompt is never
truncated by the context manager; it stays small by compacting older entries instead: recent
calls in full, older ones one line per tool (latest call, how many times), older errors counted.
"""

from __future__ import annotations

import errno
import os
import tempfile
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Literal

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


_Stamp = tuple[int, int, int]  # st_ino, st_size, st_mtime_ns of a file as this process left it


def _stamp(f: BinaryIO) -> _Stamp:
    f.flush()
    os.fsync(f.fileno())
    st = os.fstat(f.fileno())
    return st.st_ino, st.st_size, st.st_mtime_ns


def _sync_dir(path: Path) -> None:
    """Make the renames in a folder durable (some network file systems refuse; they need not)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _write_temp(path: Path, data: list[bytes]) -> tuple[Path, _Stamp]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; a result file is as readable as any
        with os.fdopen(fd, "wb") as f:
            f.writelines(data)
            return Path(tmp), _stamp(f)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: bytes | list[bytes]) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file."""
    path = Path(path)
    tmp, _ = _write_temp(path, [data] if isinstance(data, bytes) else data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _unchanged(path: Path, stamp: _Stamp) -> bool:
    """Whether `path` is the file this process left (and no other name holds it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return st.st_nlink == 1 and (st.st_ino, st.st_size, st.st_mtime_ns) == stamp


def _short(value: Any, width: int) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, str):
        text = value
    else:
        # Past `width` items the text is cut anyway (an item is over one character): the same
        # shown prefix without encoding a 200 KB table for a 40-character preview.
        if isinstance(value, list) and len(value) > width:
            value = value[:width]
        elif isinstance(value, dict) and len(value) > width:
            value = dict(islice(value.items(), width))
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
    # (head, entries, stamp) of the record file last published and of the spare (the one before)
    _published: tuple[bytes, int, _Stamp] | None = field(default=None, repr=False, compare=False)
    _spare: tuple[bytes, int, _Stamp] | None = field(default=None, repr=False, compare=False)

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

    def _head(self) -> bytes:
        head = orjson.dumps({"schema_version": SCHEMA_VERSION, "meta": self.meta}, option=_OPTS)
        return head[:-1] + b',"entries":['

    def _chunks(self, start: int = 0) -> list[bytes]:
        """Entries from `start` on, comma-separated, and the closing brackets. Entries are final
        once saved, so their encoding is kept: a save encodes only the new ones."""
        while len(self._encoded) < len(self.entries):
            self._encoded.append(orjson.dumps(self.entries[len(self._encoded)], option=_OPTS))
        chunks = []
        for i in range(start, len(self._encoded)):
            chunks += [b",", self._encoded[i]] if i else [self._encoded[i]]
        return [*chunks, b"]}"]

    def to_json(self) -> bytes:
        return b"".join([self._head(), *self._chunks()])

    def save(self, path: str | Path) -> None:
        atomic_write(path, [self._head(), *self._chunks()])

    def save_record(self, outdir: Path, step: bool = False) -> None:
        """Write the record and its copy (a hard link). Each name is swapped by a rename after an
        fsync, and the renames are made durable: a kill or a power loss leaves the old or the new
        whole record under both names.

        A step save (`step=True`, the loop's) does not rewrite the whole record (megabytes by the
        end of a long run; that was three quarters of the loop's own time): it appends the new
        entries to the spare, the record file of the save before the last, which only the hidden
        name .world_state.json.spare still holds, renames it in, and keeps the file it replaces as
        the next spare. A spare is extended only if it is as this object left it (inode, size,
        mtime, one link), else a new file is written. Other saves write a new file and drop the
        spare. A reader that keeps the file open across two steps may see it grow.

        The fsyncs stay on every save, though a killed process loses nothing in the page cache:
        since a published file is written again (as the spare) two saves later, without them a
        power loss could leave a torn record under the published names. They cost under 1 ms now
        that a step save writes only its own entries.
        """
        first, *copies = (outdir / name for name in RECORD_NAMES)
        spare, keep = (first.with_name(f".{first.name}.{x}") for x in ("spare", "keep"))
        head, n = self._head(), len(self.entries)
        old, self._spare, published, self._published = self._spare, None, self._published, None
        if step and old and old[0] == head and old[1] <= n and _unchanged(spare, old[2]):
            with open(spare, "r+b") as f:
                f.seek(old[2][1] - 2)  # over the closing "]}"
                f.writelines(self._chunks(old[1]))
                src, stamp = spare, _stamp(f)
        else:
            src, stamp = _write_temp(first, [head, *self._chunks()])
        keep.unlink(missing_ok=True)
        kept = step and first.exists()
        if kept:
            os.link(first, keep)  # the file published until now: the next spare
        os.replace(src, first)
        if kept:
            os.replace(keep, spare)
        else:
            spare.unlink(missing_ok=True)
        for copy in copies:
            copy.parent.mkdir(parents=True, exist_ok=True)
            tmp = copy.with_name(f".{copy.name}.link")
            tmp.unlink(missing_ok=True)
            os.link(first, tmp)
            os.replace(tmp, copy)
        # Durable renames before the file they replaced is written again as the spare.
        for folder in dict.fromkeys(p.parent for p in (first, *copies)):
            _sync_dir(folder)
        self._published, self._spare = (head, n, stamp), published if step else None

    @classmethod
    def load(cls, path: str | Path) -> WorldState:
        try:
            doc = orjson.loads(Path(path).read_bytes())
            return cls(meta=doc["meta"], entries=[Entry(**e) for e in doc["entries"]])
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a readable world state ({type(e).__name__}: {e})") from e

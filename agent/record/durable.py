"""Durable files: every write that a crash must not leave half done goes through here.

- ``atomic_write`` / ``atomic_write_json`` / ``atomic_write_h5ad``: a temporary file in the same
  folder, then a rename, so readers see the old file or the whole new one.
- ``publish``: an atomic write readable by all (the report's and the cohort commands' files).
- ``write_private``: a file only its owner can read (API keys).
- ``check_hard_links``: refuse a folder whose file system cannot keep linked copies.
- ``RecordWriter``: the world state's append-and-rename save, published under a name and its
  hard-linked copies.
- ``read_appended_rows``: a JSON-lines file appended row by row (a sample's or a server's metrics),
  whose lines a kill may have cut, also before rows appended later.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import orjson

_UMASK = os.umask(0o022)
os.umask(_UMASK)

_Stamp = tuple[int, int, int]  # st_ino, st_size, st_mtime_ns of a file as this process left it


def _stamp(f: BinaryIO) -> _Stamp:
    f.flush()
    os.fsync(f.fileno())
    st = os.fstat(f.fileno())
    return st.st_ino, st.st_size, st.st_mtime_ns


def sync_dir(path: Path) -> None:
    """Make the renames in a folder durable (some network file systems refuse; they need not)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _sync_dirs(folders: list[Path]) -> None:
    for folder in folders:
        sync_dir(folder)


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


def publish(path: Path, data: bytes) -> None:
    """Write atomically, readable by all: a report is for people other than its writer."""
    atomic_write(path, data)
    path.chmod(0o644)


def atomic_write_json(path: str | Path, doc: Any, indent: bool = False) -> None:
    """``doc`` as JSON (numpy values allowed), written atomically; indented for people to read."""
    opts = orjson.OPT_SERIALIZE_NUMPY | (orjson.OPT_INDENT_2 if indent else 0)
    atomic_write(path, orjson.dumps(doc, option=opts) + (b"\n" if indent else b""))


def read_appended_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file written by appending: JSON objects with a numeric ``time``
    (both metrics files stamp each row with it). A line a kill cut off is skipped and reading
    goes on: a resumed run or a restarted server appends after it, its first row on the cut
    line's end when the kill left no newline, and found there. A line that is no such row (a
    stray ``null``, a row without ``time``) is skipped too. Python's parser, which reads NaN as
    json.dumps writes it."""
    rows = []
    for line in path.read_bytes().splitlines():
        row = _last_whole_row(line)
        if isinstance(row, dict) and isinstance(row.get("time"), int | float):
            rows.append(row)
    return rows


def _last_whole_row(line: bytes) -> Any:
    """The line's JSON value; for a line cut off, the row appended on its end: the next place
    the line's own start (``{"time":``) recurs, which no value nested in a row begins with."""
    head = line[: line.find(b":") + 1] or line
    start = 0
    while start != -1:
        try:
            return json.loads(line[start:])
        except (json.JSONDecodeError, UnicodeDecodeError):
            start = line.find(head, start + 1)
    return None


def h5ad_size(adata: Any) -> int:
    """Bytes an uncompressed .h5ad of ``adata`` takes, about: its arrays, and the tables' columns."""

    def nbytes(m: Any) -> int:
        if hasattr(m, "data") and hasattr(m, "indptr"):  # sparse
            return m.data.nbytes + m.indices.nbytes + m.indptr.nbytes
        return int(getattr(m, "nbytes", 0))

    arrays = [adata.X, *adata.layers.values(), *adata.obsm.values(), *adata.obsp.values()]
    arrays += [*adata.varm.values(), adata.raw.X if adata.raw is not None else None]
    tables = sum(int(t.memory_usage(deep=True).sum()) for t in (adata.obs, adata.var))
    return sum(nbytes(m) for m in arrays if m is not None) + tables


def check_space(folder: Path, needed: int) -> None:
    """Refuse a write that cannot fit (an ENOSPC OSError, a fault of the machine) before it starts:
    h5py can crash the process on a full disk, leaving a partial file behind."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if needed + (16 << 20) > free:  # a margin for metadata and the record's own writes
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: writing about {needed / 2**20:.0f} MiB into {folder} "
            f"needs more than the {free / 2**20:.0f} MiB free",
        )


def atomic_write_h5ad(adata: Any, path: Path) -> None:
    """Write an .h5ad so that readers see the old file or the whole new one, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    check_space(path.parent, h5ad_size(adata))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        adata.write_h5ad(tmp)  # no compression: checkpoints must be cheap
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (mode 0600, also when it existed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class Unsupported(Exception):
    """The output folder's file system lacks what a run relies on (hard links, locks): no rerun
    on it can do better, so the run is refused before it starts."""


# errno of a file system that cannot do an operation at all (as opposed to failing it this time)
NOT_SUPPORTED = frozenset(
    getattr(errno, name)
    for name in ("EPERM", "EOPNOTSUPP", "ENOTSUP", "ENOSYS", "ENOLCK")
    if hasattr(errno, name)
)


def check_hard_links(folder: Path) -> None:
    """Refuse a folder whose file system cannot hard-link: the record, metrics, final data and
    plots are kept as links beside the checkpoints, which survive Snakemake's clean-up."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".links.{os.getpid()}"
    probe.touch()
    try:
        os.link(probe, probe.with_name(probe.name + ".2"))
    except OSError as e:
        if e.errno not in NOT_SUPPORTED:
            raise
        raise Unsupported(
            f"{folder} is on a file system without hard links ({e.strerror}): the copies that "
            "keep a sample's outputs through Snakemake's clean-up need them; write the results "
            "to another file system (a rerun here would end the same)"
        ) from None
    finally:
        probe.unlink()
    probe.with_name(probe.name + ".2").unlink()


def _unchanged(path: Path, stamp: _Stamp) -> bool:
    """Whether `path` is the file this process left (and no other name holds it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return st.st_nlink == 1 and (st.st_ino, st.st_size, st.st_mtime_ns) == stamp


class RecordWriter:
    """Publishes a JSON document of the shape ``head + items + tail`` under ``path`` and its
    ``copies`` (hard links). Each name is swapped by a rename after an fsync, and the renames are
    made durable: a kill or a power loss leaves the old or the new whole document under every name.

    An append save (``append=True``, the loop's every step) does not rewrite the whole document
    (megabytes by the end of a long run; that was three quarters of the loop's own time): it
    appends the new items to the spare, the file published the save before the last, which only
    the hidden name ``.NAME.spare`` still holds, renames it in, and keeps the file it replaces as
    the next spare. A spare is extended only if it is as this writer left it (inode, size, mtime,
    one link), else a new file is written. Other saves write a new file and drop the spare. A
    reader that keeps the file open across two saves may see it grow.

    The fsyncs stay, though a killed process loses nothing in the page cache: since a published
    file is written again (as the spare) two saves later, without them a power loss could leave a
    torn document under the published names. The file's own fsync comes before its renames, on
    every save. An append save leaves the folders' fsyncs (which make its renames durable) to a
    background thread, overlapping the next model request and tool call, and the next save
    waits for them before it writes anything: so no file a name may point to after a power loss
    is extended before its renames are durable, and each name still holds an old or a new whole
    document. A power loss may then lose the newest save's renames (the record is one step
    older), never a document. Other saves, and ``flush``, wait for them at once.
    """

    def __init__(self, path: Path, copies: tuple[Path, ...] = ()):
        self.path, self.copies = path, copies
        # (head, items, stamp) of the file last published and of the spare (the one before)
        self._published: tuple[bytes, int, _Stamp] | None = None
        self._spare: tuple[bytes, int, _Stamp] | None = None
        self._syncing: Future[None] | None = None  # the last append save's folder fsyncs
        self._syncer: ThreadPoolExecutor | None = None

    def flush(self) -> None:
        """Wait until the last save's renames are durable (raises what its fsyncs raised)."""
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            syncing.result()

    def _sync_folders(self, background: bool) -> None:
        folders = list(dict.fromkeys(p.parent for p in (self.path, *self.copies)))
        if not background:
            _sync_dirs(folders)
            return
        if self._syncer is None:  # its thread is joined at interpreter exit: no sync is lost
            self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record-sync")
        self._syncing = self._syncer.submit(_sync_dirs, folders)

    def save(
        self, head: bytes, n: int, body: Callable[[int], list[bytes]], append: bool = False
    ) -> None:
        """Publish ``head`` followed by ``body(0)``; ``body(k)`` must give the chunks of the items
        from the k-th on (separators included) and the closing tail of two bytes."""
        self.flush()  # the renames of the save before are durable before any file is written
        first = self.path
        spare, keep = (first.with_name(f".{first.name}.{x}") for x in ("spare", "keep"))
        old, self._spare, published, self._published = self._spare, None, self._published, None
        if append and old and old[0] == head and old[1] <= n and _unchanged(spare, old[2]):
            with open(spare, "r+b") as f:
                f.seek(old[2][1] - 2)  # over the closing tail
                f.writelines(body(old[1]))
                src, stamp = spare, _stamp(f)
        else:
            src, stamp = _write_temp(first, [head, *body(0)])
        keep.unlink(missing_ok=True)
        kept = append and first.exists()
        if kept:
            os.link(first, keep)  # the file published until now: the next spare
        os.replace(src, first)
        if kept:
            os.replace(keep, spare)
        else:
            spare.unlink(missing_ok=True)
        for copy in self.copies:
            copy.parent.mkdir(parents=True, exist_ok=True)
            tmp = copy.with_name(f".{copy.name}.link")
            tmp.unlink(missing_ok=True)
            os.link(first, tmp)
            os.replace(tmp, copy)
        # Durable renames before the file they replaced is written again as the spare.
        self._sync_folders(background=append)
        self._published, self._spare = (head, n, stamp), published if append else None


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def link_atomically(source: Path, name: Path) -> None:
    """``name`` becomes a hard link of ``source``, atomically (a reader sees one or the other)."""
    if same_file(source, name):
        return
    name.parent.mkdir(parents=True, exist_ok=True)
    tmp = name.with_name(f".{name.name}.link")
    tmp.unlink(missing_ok=True)
    os.link(source, tmp)
    os.replace(tmp, name)

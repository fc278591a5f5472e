"""One writer per sample folder: an exclusive lock held for the whole run.

The lock is ``fcntl.flock`` on a file in the folder, which the kernel (or the NFS server, whose
lease expires) releases when its holder dies however it dies: a stale lock is never in the way,
and two agents can never both hold one. The file also says who holds it (host, pid, Slurm job),
so that a refused run names the holder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import platform
from pathlib import Path
from typing import Any

import orjson

from agent.record.durable import NOT_SUPPORTED, Unsupported
from agent.record.provenance import now


class FolderBusy(Exception):
    """Another run holds the sample's folder."""


def holder() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "since": now(),
    }


def _describe(doc: dict[str, Any]) -> str:
    job = f", Slurm job {doc['slurm_job_id']}" if doc.get("slurm_job_id") else ""
    return f"pid {doc.get('pid')} on {doc.get('host')}{job}, since {doc.get('since')}"


def _who(text: bytes) -> str:
    try:
        return _describe(orjson.loads(text)) if text.strip() else "another process"
    except orjson.JSONDecodeError:
        return "another process"


def holder_of(path: Path) -> str | None:
    """Who holds the lock at ``path`` now (None: nobody, or no lock file), without taking it for
    longer than the test: the workflow asks before it deletes a folder's outputs."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return _who(os.pread(fd, 4096, 0))
        return None  # locks unsupported: the run itself refuses and says so
    finally:
        os.close(fd)  # closing releases a lock taken
    return None


class FolderLock:
    """``with FolderLock(path): ...`` holds ``path`` (created if needed) or raises FolderBusy."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self.previous: dict[str, Any] | None = None  # who held it last and did not let go

    def __enter__(self) -> FolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            text = os.pread(fd, 4096, 0)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderBusy(
                    f"{self.path.parent} is being written by another run ({_who(text)}); "
                    "one run per sample folder and one results folder per workflow: wait for "
                    "it to end, or stop it first"
                ) from None
            if e.errno in NOT_SUPPORTED:  # a file system must not be written unguarded
                raise Unsupported(
                    f"cannot lock {self.path}: its file system does not support flock "
                    f"({e.strerror}), so one writer per sample folder cannot be guaranteed; "
                    "write the results to a file system with locks (local disk, NFSv4, Lustre "
                    "mounted with -o flock)"
                ) from None
            raise
        old = os.pread(fd, 4096, 0)
        if old.strip():  # a holder that died without letting go: the kernel already has
            try:
                self.previous = orjson.loads(old)
            except orjson.JSONDecodeError:
                self.previous = {"unreadable": old[:200].decode(errors="replace")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, orjson.dumps(holder()), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # empty: nobody holds it
            os.close(self._fd)  # closing releases the flock
            self._fd = None

"""``python -m tests.eio_agent ARGS``: ``agent run`` whose first read of an .h5ad fails with an I/O
error (EIO), as a failing disk or a network file system's hiccup does, once: the file named by the
environment variable EIO_ONCE is created on that first read, and later runs read normally.
Everything else (runner, loop, tools, record, resume) is the real path."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import anndata

from agent import cli

_read_h5ad = anndata.read_h5ad


def read_h5ad_failing_once(path, *args, **kwargs):
    marker = Path(os.environ["EIO_ONCE"])
    if not marker.exists():
        marker.touch()
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
    return _read_h5ad(path, *args, **kwargs)


if __name__ == "__main__":
    anndata.read_h5ad = read_h5ad_failing_once
    sys.exit(cli.main(["run", *sys.argv[1:]]))

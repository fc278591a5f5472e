"""``python -m tests.signal_agent ARGS``: ``agent run`` whose first ``rank_genes_groups`` receives
SIGTERM while scanpy's numba kernel runs, as a Slurm time limit on a large sample does: before the
call's own statistics, the kernel behind them (``sparse_mean_variance_axis``) runs over a large
matrix while a timer sends the signal, once (the file named by the environment variable
SIGTERM_ONCE is created then; later runs call the tool as it is). A signal that lands in compiled
code surfaces as whatever exception numba raises on return (SystemError), not as the handler's.
Everything else (runner, loop, registry, record, resume) is the real path."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import scanpy.tools._rank_genes_groups as rank_genes
import scipy.sparse as sp
from scanpy.preprocessing._utils import sparse_mean_variance_axis

from agent import cli

_get_mean_var = rank_genes._get_mean_var


def mean_var_stopped_once(x, *args, **kwargs):
    marker = Path(os.environ["SIGTERM_ONCE"])
    if not marker.exists():
        marker.touch()
        large = sp.random(20000, 3000, density=0.1, format="csr", random_state=0, dtype="float32")
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        for _ in range(300):  # ~0.1 s each: the signal lands inside one of them
            sparse_mean_variance_axis(large, 0)
    return _get_mean_var(x, *args, **kwargs)


if __name__ == "__main__":
    rank_genes._get_mean_var = mean_var_stopped_once
    sys.exit(cli.main(["run", *sys.argv[1:]]))

"""A stop signal that lands in numba-compiled code: what surfaces, and what the registry makes of it.

Each trial sends this process SIGTERM from a timer (after a random 20-200 ms) while scanpy's
numba kernel behind rank_genes_groups' statistics (``sparse_mean_variance_axis``) runs in a loop
over a 20,000 x 3,000 sparse matrix, under the run's signal handling (``agent.signals``), as a
Slurm time limit on a large sample does. Two arms, the same trials:

  kernel    the kernel called directly: which exception surfaces (the handler's Interrupted, or
            numba's SystemError "returned a result with an exception set", which loses it);
  registry  the kernel inside a tool called through ``ToolRegistry.call``, as the loop calls
            every tool: whether the run ends Interrupted (the call not recorded) or the stop
            becomes a recorded tool error (issue 41's fault).

    python -m bench.signal_in_numba [--trials 300]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
from collections import Counter
from typing import Any

import scipy.sparse as sp
from scanpy.preprocessing._utils import sparse_mean_variance_axis

from agent import signals
from agent.registry import ToolRegistry, tool
from bench import _report

MATRIX = sp.random(20000, 3000, density=0.1, format="csr", random_state=0, dtype="float32")


def kernel_until_stopped() -> None:
    while True:
        sparse_mean_variance_axis(MATRIX, 0)


@tool("markers")
def stopped_kernel(session: Any) -> dict[str, Any]:
    """The kernel, looped until the stop arrives."""
    kernel_until_stopped()
    return {}


def trial(call: Any, rng: random.Random) -> str:
    """What one stop turns into: the name of what surfaced, or the registry's outcome."""
    timer = threading.Timer(rng.uniform(0.02, 0.2), os.kill, (os.getpid(), signal.SIGTERM))
    try:
        with signals.interruptible():
            timer.start()
            outcome = call()
    except signals.Interrupted:
        return "Interrupted (run stops, call not recorded)"
    except Exception as e:
        return type(e).__name__
    finally:
        timer.join()
    return f"recorded as a tool {outcome.status}: {(outcome.error or '')[:60]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=300)
    args = parser.parse_args()
    _report.header("A stop signal inside numba-compiled code")
    sparse_mean_variance_axis(MATRIX, 0)  # compiled before the first trial
    registry = ToolRegistry([stopped_kernel])
    arms = {
        "kernel": kernel_until_stopped,
        "registry": lambda: registry.call("stopped_kernel", {}, None),
    }
    rows = []
    for arm, call in arms.items():
        rng = random.Random(0)
        counts = Counter(trial(call, rng) for _ in range(args.trials))
        rows += [(arm, what, n, f"{n / args.trials:.1%}") for what, n in counts.most_common()]
    print(_report.table(("arm", "what the stop became", "trials", "share"), rows, left=2))
    print(_report.load_line("at end"))


if __name__ == "__main__":
    main()

"""`python -m agent replay`: replay one record and write its replay.json (agent/replay/); the
exit statuses are ``main``'s."""

from __future__ import annotations

import argparse
from pathlib import Path

from agent import say
from agent.record.durable import atomic_write_json
from agent.record.layout import SampleLayout
from agent.replay.compare import ATOL, RTOL, Tolerance
from agent.replay.run import ReplayError, machine_fault, replay
from agent.signals import Interrupted, interruptible

EXIT_MACHINE = 4


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
        if not machine_fault(e):
            raise
        say.error(f"{doc['sample']}: {doc['summary']}; cannot write {out}: {e}")
        return EXIT_MACHINE
    print(f"{doc['sample']}: {doc['verdict']} ({doc['summary']}); wrote {out}")
    if doc["machine_fault"]:
        return EXIT_MACHINE
    if doc["verdict"] == "not replayed":
        return 3
    return 1 if doc["integrity"] or doc["diverged_step"] is not None or doc["replay_error"] else 0

"""`python -m agent run`: analyse one sample, writing the world state and metrics as it goes."""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from agent.context import ContextManager, TokenCounter, tokenizer_estimate
from agent.loop import METRICS_NAMES, run_loop
from agent.policies.base import Policy
from agent.prompts import BRIEF, RESUMED, SYSTEM_PROMPT
from agent.world_state import RECORD_NAMES, WorldState

PACKAGES = (
    "scagent",
    "scanpy",
    "anndata",
    "numpy",
    "scipy",
    "pandas",
    "scikit-learn",
    "umap-learn",
    "igraph",
    "leidenalg",
    "openai",
    "orjson",
    "pydantic",
)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def checksum(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names and contents, in sorted order)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def make_policy(
    args: argparse.Namespace, meta: dict[str, Any]
) -> tuple[Policy, int | None, str | None]:
    """The policy the user asked for, the server's context limit when it tells one, and where
    the model's tokenizer lies when it is on this file system."""
    if args.policy == "reference":
        from agent.policies.reference import ReferencePolicy

        return ReferencePolicy(), None, None
    if args.policy == "replay":
        from agent.policies.replay import ReplayPolicy

        if not args.world_state:
            raise SystemExit(
                "--policy replay needs --world-state FILE (the recorded run to replay)"
            )
        return ReplayPolicy(WorldState.load(args.world_state)), None, None
    from agent.policies.llm import LLMPolicy
    from agent.serve.endpoint import read_endpoint, wait_until_ready

    if args.endpoint_file:
        ep = read_endpoint(args.endpoint_file)
        url, model, key, endpoint_file = ep.url, ep.model, ep.api_key, args.endpoint_file
        meta["server_flags"] = ep.flags
        tokenizer = args.tokenizer or ep.info.get("model_path")
    elif args.base_url and args.model:
        url, model = args.base_url, args.model
        key = Path(args.api_key_file).read_text().strip() if args.api_key_file else "EMPTY"
        tokenizer, endpoint_file = args.tokenizer, None
    else:
        raise SystemExit(
            "--policy llm needs --endpoint-file FILE, or --base-url URL and --model NAME"
        )
    meta["model"] = model
    wait_until_ready(url, api_key=key, model=model, timeout_s=args.server_wait)
    policy = LLMPolicy(
        url,
        model,
        api_key=key,
        timeout=args.request_timeout,
        max_retries=args.request_retries,
        seed=args.seed,
        max_tokens=args.max_tokens,
        outage_wait=args.outage_wait,
        endpoint_file=endpoint_file,
    )
    return policy, policy.context_limit(), tokenizer


def resume_point(outdir: Path, input_sha256: str, fresh: bool) -> WorldState | None:
    """The unfinished record of an earlier run of this sample on the same input, if any."""
    path = outdir / RECORD_NAMES[1]
    if fresh or not path.exists():
        return None
    try:
        earlier = WorldState.load(path)
    except ValueError as e:  # writes are atomic, so only outside damage does this
        raise SystemExit(
            f"cannot resume: {e}; rerun with --fresh to start this sample over"
        ) from None
    if earlier.meta.get("status") == "finished" or earlier.meta.get("input_sha256") != input_sha256:
        return None
    return earlier


def catch_up(world: WorldState, session: Any, registry: Any) -> dict[str, Any]:
    """Bring the session to the state after the last recorded step: load the newest checkpoint
    that holds its step's recorded data (a damaged one is passed over), then re-run the recorded
    calls after it, checking each lands on its recorded digest. Returns what was done, for meta."""
    last = world.entries[-1].step if world.entries else 0
    digests = {e.step: e.digest_after for e in world.entries}
    restored, rejected = session.restore(last, digests)
    restored = restored or 0
    for e in world.entries:
        if e.step <= restored or e.status != "ok":
            continue
        out = registry.call(e.tool, e.params, session)
        if not out.ok or session.digest() != e.digest_after:
            raise RuntimeError(
                f"cannot resume: step {e.step} ({e.tool}) did not reproduce its recorded result "
                f"({out.error or 'data digest differs'}); rerun with --fresh"
            )
    done = {"at_step": world.next_step, "checkpoint_step": restored, "time": now()}
    return {**done, "rejected_checkpoints": rejected} if rejected else done


def keep_metrics(outdir: Path, fresh: bool) -> None:
    """metrics.jsonl is a declared output, which Snakemake deletes when a job fails: the loop
    appends to a hard link of a file kept beside the checkpoints, so a resumed run goes on with
    the rows of the attempts before it."""
    path, kept = (outdir / name for name in METRICS_NAMES)
    if fresh:
        kept.unlink(missing_ok=True)
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.touch()
    path.unlink(missing_ok=True)
    os.link(kept, path)


def run_sample(args: argparse.Namespace) -> str:
    from agent.tools import build_registry
    from agent.tools.session import DIGEST_VERSION, Session

    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    input_path = Path(args.input)
    if not input_path.exists():
        raise SystemExit(f"input {input_path} does not exist (expected a 10x folder, .h5 or .h5ad)")
    sample = args.sample or input_path.stem
    input_sha256 = checksum(input_path)
    world = resume_point(outdir, input_sha256, args.fresh)
    keep_metrics(outdir, fresh=world is None)
    if world is None:
        world = WorldState(
            meta={
                "sample": sample,
                "input": str(input_path.resolve()),
                "input_sha256": input_sha256,
                "started": now(),
                "resumed": [],
            }
        )
    meta = world.meta
    meta.update(
        policy=args.policy,
        model=None,
        server_flags=None,
        seed=args.seed,
        versions=versions(),
        digest_version=DIGEST_VERSION,
        host=platform.node(),
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        ended=None,
        status="running",
    )
    meta.pop("error", None)
    policy, server_limit, tokenizer = make_policy(args, meta)
    meta["context_limit"] = server_limit or args.context_limit
    registry = build_registry()
    context = ContextManager(
        SYSTEM_PROMPT,
        registry.schemas(),
        meta["context_limit"],
        completion_reserve=args.max_tokens,
        counter=TokenCounter(tokenizer_estimate(tokenizer)),
    )
    context.add_user(BRIEF.format(sample=sample, input=input_path.name, brief=args.brief or ""))
    session = Session(outdir, seed=args.seed, input_path=input_path)
    try:
        if world.entries:
            resumed = catch_up(world, session, registry)
            meta["resumed"].append(resumed)
            context.add_user(RESUMED.format(step=world.next_step - 1))
            print(
                f"[{sample}] resuming after step {world.next_step - 1} "
                f"(checkpoint of step {resumed['checkpoint_step']}"
                + "".join(f"; passed over {r}" for r in resumed.get("rejected_checkpoints", []))
                + ")",
                file=sys.stderr,
            )
        status = run_loop(
            policy, registry, session, world, context, outdir, max_steps=args.max_steps
        )
    except BaseException as e:  # the record must say how the run ended, whatever ended it
        meta.update(status="failed", error=f"{type(e).__name__}: {e}", ended=now())
        world.save_record(outdir)
        raise
    meta.update(status=status, ended=now(), truncations=context.truncations)
    if status != "finished":
        last_error = next((e.error for e in reversed(world.entries) if e.error), None)
        meta["error"] = f"run ended without finish ({status}); last error: {last_error}"
    world.save_record(outdir)
    return status


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="10x mtx folder, 10x .h5 or .h5ad of raw counts")
    p.add_argument("--outdir", required=True, help="the sample's output folder")
    p.add_argument("--sample", help="sample name (default: the input's name)")
    p.add_argument("--policy", choices=["reference", "llm", "replay"], default="reference")
    p.add_argument("--endpoint-file", help="endpoint JSON written by `python -m agent serve`")
    p.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. http://host:8000/v1")
    p.add_argument("--model", help="model name on that server")
    p.add_argument("--api-key-file", help="file holding the server's API key")
    p.add_argument("--brief", help="extra instructions for this sample")
    p.add_argument("--world-state", help="recorded world_state.json (for --policy replay)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start over even if an unfinished record of this sample exists",
    )
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument(
        "--context-limit",
        type=int,
        default=32768,
        help="used when the server does not report max_model_len",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=1024,
        help="completion limit per reply, reserved in the context budget",
    )
    p.add_argument("--tokenizer", help="model folder with tokenizer.json, for exact local counts")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds one model request may take before it is retried",
    )
    p.add_argument(
        "--request-retries",
        type=int,
        default=5,
        help="retries of a failed or timed-out request (exponential backoff) before the outage wait",
    )
    p.add_argument(
        "--server-wait", type=float, default=600.0, help="seconds to wait for server health"
    )
    p.add_argument(
        "--outage-wait",
        type=float,
        default=900.0,
        help="seconds to wait for a server that died or stalled mid-run before failing"
        " (the record stays resumable; with --endpoint-file a restarted server is followed)",
    )


def main(args: argparse.Namespace) -> int:
    """0 when the run ended with a complete record, even an unfinished analysis (a bad input is
    the sample's result, shown as failed in the report; rerunning would not change it); non-zero
    when something outside the analysis broke it (server gone, crash): a retry resumes it."""
    from agent.policies.llm import ServerUnavailable

    try:
        status = run_sample(args)
    except ServerUnavailable as e:  # the record says so too; a rerun resumes
        print(f"{args.sample or args.input}: {e}", file=sys.stderr)
        return 1
    if status != "finished":
        print(
            f"{args.sample or args.input}: analysis ended without finish ({status}); "
            f"see {args.outdir}/world_state.json",
            file=sys.stderr,
        )
    return 0

"""Analyse one sample: ``run_sample(RunConfig(...))``, and `python -m agent run`, which builds the
config from its options. The record (world state) and metrics are written as the loop goes."""

from __future__ import annotations

import argparse
import os
import platform
import sys

from pydantic import ValidationError

from agent.config import RunConfig
from agent.context import ContextManager, TokenCounter, tokenizer_estimate
from agent.loop import run_loop
from agent.policies import make_policy
from agent.policies.base import PolicyUnavailable
from agent.prompts import BRIEF, RESUMED, SYSTEM_PROMPT
from agent.provenance import checksum, now, versions
from agent.resume import catch_up, keep_metrics, resume_point
from agent.world_state import WorldState


def run_sample(config: RunConfig) -> str:
    """Run (or resume) one sample's analysis; returns how the loop ended ("finished",
    "step_limit", "repeated_failures"). The record says the same, and why."""
    from agent.tools import build_registry
    from agent.tools.session import DIGEST_VERSION, Session

    layout = config.layout
    layout.root.mkdir(parents=True, exist_ok=True)
    if not config.input.exists():
        raise SystemExit(
            f"input {config.input} does not exist (expected a 10x folder, .h5 or .h5ad)"
        )
    sample = config.sample_name
    input_sha256 = checksum(config.input)
    world = resume_point(layout, input_sha256, config.fresh)
    keep_metrics(layout, fresh=world is None)
    if world is None:
        world = WorldState(
            meta={
                "sample": sample,
                "input": str(config.input.resolve()),
                "input_sha256": input_sha256,
                "started": now(),
                "resumed": [],
            }
        )
    meta = world.meta
    meta.update(
        policy=config.policy,
        model=None,
        server_flags=None,
        seed=config.seed,
        versions=versions(),
        digest_version=DIGEST_VERSION,
        host=platform.node(),
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        ended=None,
        status="running",
    )
    meta.pop("error", None)
    registry = build_registry()
    setup = make_policy(config, registry)
    meta.update(setup.meta)
    meta["context_limit"] = setup.context_limit or config.context_limit
    context = ContextManager(
        SYSTEM_PROMPT,
        registry.schemas(),
        meta["context_limit"],
        completion_reserve=config.max_tokens,
        counter=TokenCounter(tokenizer_estimate(setup.tokenizer)),
    )
    context.add_user(
        BRIEF.format(sample=sample, input=config.input.name, brief=config.brief or "")
    )
    session = Session(layout.root, seed=config.seed, input_path=config.input)
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
            setup.policy, registry, session, world, context, layout, max_steps=config.max_steps
        )
    except BaseException as e:  # the record must say how the run ended, whatever ended it
        meta.update(status="failed", error=f"{type(e).__name__}: {e}", ended=now())
        world.save_record(layout)
        raise
    meta.update(status=status, ended=now(), truncations=context.truncations)
    if status != "finished":
        last_error = next((e.error for e in reversed(world.entries) if e.error), None)
        meta["error"] = f"run ended without finish ({status}); last error: {last_error}"
    world.save_record(layout)
    return status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    RunConfig.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """0 when the run ended with a complete record, even an unfinished analysis (a bad input is
    the sample's result, shown as failed in the report; rerunning would not change it); non-zero
    when something outside the analysis broke it (server gone, crash): a retry resumes it."""
    try:
        config = RunConfig.from_args(args)
    except ValidationError as e:
        problems = "; ".join(
            (f"--{err['loc'][0].replace('_', '-')}: " if err["loc"] else "")
            + err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        )
        print(f"agent run: {problems}", file=sys.stderr)
        return 2
    try:
        status = run_sample(config)
    except PolicyUnavailable as e:  # the record says so too; a rerun resumes
        print(f"{config.sample_name}: {e}", file=sys.stderr)
        return 1
    if status != "finished":
        print(
            f"{config.sample_name}: analysis ended without finish ({status}); "
            f"see {config.layout.record}",
            file=sys.stderr,
        )
    return 0

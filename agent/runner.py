"""Analyse one sample: ``run_sample(RunConfig(...))``, and `python -m agent run`, which builds the
config from its options. The record (world state) and metrics are written as the loop goes."""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from agent import checks, say
from agent.config import LOAD_OPTIONS, RunConfig
from agent.context import ContextManager, TokenCounter, tokenizer_estimate
from agent.endpoint import PolicyUnavailable
from agent.exit_status import ExitStatus, epilog
from agent.loop import input_refusal, run_loop
from agent.policies import make_policy
from agent.prompts import BRIEF, RESUMED, SYSTEM_PROMPT
from agent.record.durable import Unsupported, check_hard_links
from agent.record.lock import FolderBusy, FolderLock
from agent.record.models import RunMeta
from agent.record.provenance import checksum, file_sha256, input_checksums, now, versions
from agent.record.world_state import RECORD_VERSION, WorldState
from agent.registry import InfrastructureError
from agent.resume import (
    CannotReuse,
    catch_up,
    ended_with_finish,
    keep_metrics,
    plan,
    publish,
    refuse_another_model,
    remove_temporary,
)
from agent.signals import Interrupted, interruptible
from agent.tool_declarations import FINISH


class BadInput(Exception):
    """The input cannot be analysed at all (missing, or not a file or folder)."""


def check_input(config: RunConfig) -> None:
    path = config.input
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise BadInput(
            f"input {path} does not exist (expected a 10x folder, .h5 or .h5ad)"
        ) from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # reading a FIFO or device never ends
        raise BadInput(
            f"input {path} is not a regular file or folder (expected a 10x folder, .h5 or .h5ad)"
        )
    ahead = path.stat().st_mtime - time.time()
    if ahead > 60:  # a node's clock behind the file server's
        print(
            f"[{config.sample_name}] input {path} was modified {ahead:.0f} s in the future: "
            "Snakemake will find every output older than it, fail the job and delete them (copies "
            "beside the checkpoints keep them); fix the clock or touch the input",
            file=sys.stderr,
        )


def run_sample(config: RunConfig) -> str:
    """Run, resume or keep one sample's analysis; returns how it ended ("finished", "partial",
    "step_limit", "repeated_failures", "input_refused"). The record says the same, and why. Raises
    FolderBusy, CannotReuse, BadInput (nothing was started) and PolicyUnavailable,
    InfrastructureError, Interrupted (the record says so; a rerun resumes)."""
    check_input(config)
    layout = config.layout
    with FolderLock(layout.lock) as lock:
        if lock.previous:
            print(
                f"[{config.sample_name}] took over the lock of a run that ended without "
                f"letting go: {lock.previous}",
                file=sys.stderr,
            )
        remove_temporary(layout)
        check_hard_links(layout.root)
        try:
            sums = input_checksums(config.input)
        except OSError as e:
            raise InfrastructureError(f"cannot read input {config.input}: {e}") from e
        # what decides an analysis besides its code: kept or resumed only under the same
        wanted = RunMeta.part(
            sample=config.sample_name,
            input_sha256=checksum(config.input, sums),
            policy=config.policy,
            seed=config.seed,
            brief=config.brief,
            **{k: getattr(config, k) for k in LOAD_OPTIONS},
            # the reference model's content, not its place: a changed model redoes the sample
            celltypist_model_sha256=model_sha256(config),
            doublets=config.doublets,
            raw_input_sha256=raw_sha256(config),  # the soup's droplets: content, not place
        )
        action, world = plan(layout, wanted, config.max_steps, config.fresh, config.replace_changed)
        if action == "keep":
            return _keep(world, layout)
        if action == "resume":  # the attempt before's plots, which Snakemake deleted, come back
            publish(layout)
        if world is None:
            world = WorldState(
                meta={
                    **wanted,
                    **RunMeta.part(
                        input=str(config.input.resolve()),
                        input_files=sums,
                        celltypist_model=model_path(config),
                        raw_input=str(config.raw_input.resolve()) if config.raw_input else None,
                        started=now(),
                        resumed=[],
                    ),
                }
            )
        keep_metrics(layout, fresh=action == "new")
        return _run(config, world, layout, wanted)


def _keep(world: WorldState, layout: Any) -> str:
    meta = world.meta
    ended = ended_with_finish(world)
    if ended and meta.get("status") != ended:
        # killed after `finish` succeeded, before the record said so: it ended as finish said
        meta.update(RunMeta.part(status=ended, ended=now()))
        meta.pop("error", None)
        _conclude(world, ended)
        world.save_record(layout)
    publish(layout)
    print(
        f"[{meta['sample']}] kept the analysis already in {layout.root} ({meta['status']}, "
        f"{len(world.entries)} steps, ended {meta.get('ended')}); --fresh redoes it",
        file=sys.stderr,
    )
    return meta["status"]


def _mark_running(world: WorldState, config: RunConfig) -> None:
    """The record's meta as this attempt begins: who runs it, where, with which versions."""
    from agent.digest import DIGEST_VERSION

    meta = world.meta
    meta.update(
        RunMeta.part(
            policy=config.policy,
            model=None,
            server_flags=None,
            server=None,  # the policy's setup fills these three for a model it asks
            sampling=None,
            prompt_digest=None,
            seed=config.seed,
            versions=versions(),
            digest_version=DIGEST_VERSION,
            host=platform.node(),
            slurm_job_id=os.environ.get("SLURM_JOB_ID"),
            ended=None,
            status="running",
        )
    )
    meta.pop("error", None)
    meta.pop("checks", None)  # a resumed run's are written again when it ends
    if not world.entries:  # a resumed record keeps the version it was begun with
        meta.update(RunMeta.part(record_version=RECORD_VERSION))


def _run(config: RunConfig, world: WorldState, layout: Any, wanted: dict[str, Any]) -> str:
    from agent.tools import build_registry
    from agent.tools.session import Session

    sample, meta = config.sample_name, world.meta
    # the record as it was, for the second look of the rule table once the model is known
    recorded = WorldState(meta=dict(meta), entries=world.entries) if world.entries else None
    _mark_running(world, config)
    registry = build_registry()
    context = None
    try:
        setup = make_policy(config, registry)
        refuse_another_model(layout, recorded, wanted, config.max_steps, setup.meta.get("model"))
        meta.update(setup.meta)
        meta.update(RunMeta.part(context_limit=setup.context_limit or config.context_limit))
        context = ContextManager(
            SYSTEM_PROMPT,
            registry.schemas(),
            meta["context_limit"],
            completion_reserve=setup.max_tokens,
            history_reasoning=setup.history_reasoning,
            counter=TokenCounter(tokenizer_estimate(setup.tokenizer)),
        )
        if config.policy == "llm":  # the only policy that is told anything
            meta.update(
                RunMeta.part(prompt_digest=prompt_digest(context.system_prompt, context.tools))
            )
        context.add_user(BRIEF.format(sample=sample, input=config.input.name, brief=_brief(config)))
        session = Session(
            layout.root, seed=config.seed, input_path=config.input,
            celltypist_model=config.celltypist_model,
            celltypist_model_sha256=wanted["celltypist_model_sha256"],  # checked at each use
            doublets=config.doublets,
            raw_input=config.raw_input,
        )  # fmt: skip
        if world.entries:
            resumed = catch_up(world, session, registry)
            meta["resumed"] += RunMeta.part(resumed=[resumed])["resumed"]
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
    except CannotReuse:
        raise  # the record is as it was: nothing of this run was recorded
    except Interrupted as e:  # the record must say how the run ended, whatever ended it
        meta.update(
            RunMeta.part(
                status="interrupted",
                error=f"{e} after step {world.next_step - 1}; a rerun resumes",
                ended=now(),
            )
        )
        _record_ending(world, layout)
        raise
    except BaseException as e:
        meta.update(RunMeta.part(status="failed", error=f"{type(e).__name__}: {e}", ended=now()))
        _record_ending(world, layout)
        raise
    meta.update(RunMeta.part(status=status, ended=now(), truncations=context.truncations))
    _conclude(world, status)
    world.save_record(layout)
    publish(layout)
    return status


def _conclude(world: WorldState, status: str) -> None:
    """What the record's meta says of a run that ended with its own result: why it did not finish
    (``error``), and every check of its decisions (``checks``)."""
    error = None
    if status == "input_refused":
        error = f"input refused: {input_refusal(world)}"
    elif status == "partial":
        done = world.last_ok(FINISH)
        reason = (done.params.get("partial") if done else None) or "not given"
        missing = ", ".join(((done.result or {}).get("missing") or {}) if done else ()) or "none"
        error = f"partial analysis: {reason} (stages missing: {missing})"
    elif status != "finished":
        last_error = next((e.error for e in reversed(world.entries) if e.error), None)
        error = f"run ended without finish ({status}); last error: {last_error}"
    found = [c.model_dump() for c in checks.collect(world.entries)]
    world.meta.update(RunMeta.part(**({"error": error} if error else {}), checks=found))


def _record_ending(world: WorldState, layout: Any) -> None:
    """Save the record that says how a run broke off, and keep copies of what it published. When
    even that fails (the disk is full), the log says so: the record still says running."""
    sample = world.meta.get("sample")
    try:
        world.save_record(layout)
    except OSError as e:
        print(
            f"[{sample}] could not save the record to say {world.meta['status']!r} "
            f"({world.meta.get('error')}): {e}; {layout.record_copy} still says running after "
            f"step {world.next_step - 1}, and a rerun resumes from it",
            file=sys.stderr,
        )
        return
    try:
        publish(layout)
    except OSError as e:  # the record is saved; only the published names may lack their files
        print(f"[{sample}] could not publish the outputs in {layout.root}: {e}", file=sys.stderr)


def prompt_digest(system_prompt: str, tools: list[dict[str, Any]]) -> str:
    """sha256 of what a model is told before any data: the system prompt and the tool schemas,
    in the order sent (key order included: the chat template renders them as given), so two
    records show at a glance whether their models read the same instructions."""
    sent = orjson.dumps({"system": system_prompt, "tools": tools})
    return hashlib.sha256(sent).hexdigest()


def model_path(config: RunConfig) -> str | None:
    """The run's CellTypist model as an absolute path (replay passes it on), None without one."""
    return str(config.celltypist_model.resolve()) if config.celltypist_model else None


def _sha256_of(path: Path | None, digest: Callable[[Path], str]) -> str | None:
    """``digest`` of a file the run was given, None without one; unreadable: a machine fault."""
    if path is None:
        return None
    try:
        return digest(path)
    except OSError as e:
        raise InfrastructureError(f"cannot read {path}: {e}") from e


def raw_sha256(config: RunConfig) -> str | None:
    """sha256 of the run's unfiltered droplet matrix (--raw-input; a folder's files), or None."""
    return _sha256_of(config.raw_input, checksum)


def model_sha256(config: RunConfig) -> str | None:
    """sha256 of the run's CellTypist model file, or None."""
    return _sha256_of(config.celltypist_model, file_sha256)


def _brief(config: RunConfig) -> str:
    """The sample's instructions, with the load_data arguments its run options set, the
    reference model it gives and what becomes of its doublets."""
    options = ", ".join(f"{k}={v!r}" for k, v in config.load_options.items())
    load = f"Load the counts with load_data({options})." if options else ""
    model = (
        f"A CellTypist reference model ({config.celltypist_model.name}) is given: label the cell "
        "types with annotate_celltypist (marker sets may be compared under another key_added)."
        if config.celltypist_model
        else ""
    )
    doublets = (
        "Doublets are flagged, not removed: call detect_doublets and keep its predicted doublets "
        "(markers and labels leave them out); do not call remove_doublets."
        if config.doublets == "flag"
        else ""
    )
    return " ".join(part for part in (config.brief, load, model, doublets) if part)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    RunConfig.add_arguments(parser)
    parser.epilog = epilog()


def main(args: argparse.Namespace) -> int:
    """The run's exit status (agent/exit_status.py): ``COMPLETE`` also for a partial or unfinished
    analysis (partial: amber in the report; repeated failures, step limit: failed); ``BROKEN``
    when a retry (with more memory) resumes it; ``INPUT_REFUSED`` when no option the record's
    meta.error names helped, so a rerun with the same input and options ends the same.
    A run that started ends with one closing line: how it ended, steps, seconds, the record."""
    t0 = time.monotonic()
    try:
        config = RunConfig.from_args(args)
    except ValidationError as e:
        problems = "; ".join(
            (f"--{err['loc'][0].replace('_', '-')}: " if err["loc"] else "")
            + err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        )
        say.error(f"{problems}")
        return ExitStatus.REFUSED
    name, record = config.sample_name, config.layout.record

    def closing(ended: str, why: str = "") -> None:
        seconds = f"{time.monotonic() - t0:.1f} s"
        try:
            steps = f"{len(WorldState.load(record).entries)} steps in {seconds}; record {record}"
        except ValueError:  # it failed before its first save
            steps = f"no record after {seconds}"
        print(f"[{name}] {ended}: {steps}{why}", file=sys.stderr)

    try:
        with interruptible():
            status = run_sample(config)
    except (BadInput, CannotReuse, Unsupported) as e:  # refused: nothing of this run recorded
        say.error(f"{name}: {e}")
        return ExitStatus.REFUSED
    except FolderBusy as e:  # another run writes the record: not this run's to summarise
        say.error(f"{name}: {e}")
        return ExitStatus.BROKEN
    except (PolicyUnavailable, InfrastructureError, OSError) as e:
        closing(f"failed (exit {ExitStatus.BROKEN})", f"; {e}; a rerun resumes")
        return ExitStatus.BROKEN
    except Interrupted as e:
        closing(f"{e} (exit {e.exit_code})", "; it says so and a rerun resumes")
        return e.exit_code
    if status == "input_refused":
        error = WorldState.load(record).meta.get("error", "")
        closing(f"input refused (exit {ExitStatus.INPUT_REFUSED})", f"; {error}")
        return ExitStatus.INPUT_REFUSED
    if status in ("finished", "partial"):
        closing(
            status, "" if status == "finished" else f"; {WorldState.load(record).meta['error']}"
        )
    else:
        closing(f"analysis ended without finish ({status})")
    return ExitStatus.COMPLETE

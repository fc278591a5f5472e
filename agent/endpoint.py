"""The endpoint file, the one contract between a server and its agents: ``write_endpoint`` (the
launcher's side) and ``read_endpoint`` (the agents'), the API key file, and the wait on health.

The endpoint file is JSON written by ``python -m agent serve`` once the server has answered
``/health``, listed its model and served a warm-up request. It names the key *file*, never the key;
the key file must be readable by its owner only, because a compute node's port is reachable by
every user of the cluster. Agents need no launcher code to read it.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.record.durable import atomic_write_json


# Here, below the policies, so that the endpoint's own errors can be one of them.
class PolicyUnavailable(Exception):
    """The decider cannot be reached or used: it stayed unreachable past its wait, or refused us
    at once (a wrong key, a stale endpoint); ``outages``: the waits for it, as in
    ``agent.policies.base.Decision.outages``."""

    def __init__(self, message: str, outages: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.outages = outages or []


class EndpointError(PolicyUnavailable):
    """An endpoint file that cannot be used, or a server that did not become ready. A
    PolicyUnavailable, so that the runner ends the run with one line and a record."""


class KeyRefused(EndpointError):
    """The server refused the API key (HTTP 401 or 403): final at once, as no wait changes a key."""

    def __init__(
        self,
        url: str,
        answer: str,
        key_file: str | Path | None = None,
        endpoint_file: str | Path | None = None,
        outages: list[dict[str, Any]] | None = None,
    ):
        key = f"the API key in {key_file}" if key_file else "the API key"
        message = f"server {url} refused {key} ({answer})"
        if endpoint_file:
            message += (
                f": the server was restarted with a new key (or another server took its port) "
                f"and {endpoint_file} does not name it; rerun once its launcher has written the "
                f"file again"
            )
        else:
            message += ": not the server's key; give the server's key file (--api-key-file)"
        super().__init__(message, outages)
        self.answer = answer


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL for the OpenAI client, ending in /v1
    model: str
    api_key: str | None = field(repr=False)
    max_model_len: int
    flags: list[dict[str, Any]] = field(repr=False)
    path: Path | None = None
    info: dict[str, Any] = field(default_factory=dict, repr=False)
    key_file: Path | None = None  # where api_key came from, for messages


def read_api_key(path: str | Path) -> str:
    """The key in ``path``; refuses a file that group or others may read or write, as ssh does
    for a private key: on a shared cluster they could use the key, or replace it."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        if not stat.S_ISREG(mode):
            raise EndpointError(f"API key file {p}: not a regular file")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise EndpointError(
                f"API key file {p}: mode {stat.S_IMODE(mode):03o} gives group or others access "
                f"to the key; expected the owner's only (chmod 600 {p})"
            )
        key = p.read_text().strip()
    except OSError as exc:
        raise EndpointError(f"API key file {p}: {exc.strerror}") from exc
    if not key:
        raise EndpointError(f"API key file {p}: empty")
    return key


# What agents rely on, with its JSON type; everything else in the file is the launcher's account
# of the server (flags and reasons, vLLM version, timings...), kept for the record.
REQUIRED = (("url", str), ("model", str), ("max_model_len", int))


def write_endpoint(
    path: Path,
    *,
    url: str,
    model: str,
    api_key_file: Path,
    max_model_len: int,
    flags: list[dict[str, Any]],
    **details: Any,
) -> None:
    """Publish a ready server (atomically: agents never read half a file).

    ``details`` are the launcher's record of the server (``model_path``, ``argv``, ``timings``...),
    stored as given; the key itself never goes into the file, only ``api_key_file``. The writer's
    host, pid and Slurm job go in too: readers tell a file left by a dead launcher from a live one.
    """
    if "api_key" in details:
        raise ValueError("the endpoint file names the key file (api_key_file), never the key")
    doc = {
        "url": url,
        "model": model,
        "api_key_file": str(Path(api_key_file).resolve()),
        "max_model_len": max_model_len,
        "flags": flags,
        "hostname": socket.gethostname(),
        "launcher_pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        **details,
    }
    atomic_write_json(path, doc, indent=True)


def _writer(info: dict[str, Any]) -> str:
    """Who wrote an endpoint file, for messages."""
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return f"launcher pid {info.get('launcher_pid', '?')} on host {info.get('hostname', '?')}{job}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def read_info(p: Path, required: tuple[tuple[str, type], ...] = REQUIRED) -> dict[str, Any]:
    """The endpoint file's JSON object, with the ``required`` fields of their types."""
    try:
        info = json.loads(p.read_text())
    except OSError as exc:
        raise EndpointError(f"endpoint file {p}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise EndpointError(f"endpoint file {p}: not valid JSON ({exc})") from exc
    if not isinstance(info, dict):
        raise EndpointError(f"endpoint file {p}: expected a JSON object")
    for key, kind in required:
        if not isinstance(info.get(key), kind):
            raise EndpointError(
                f"endpoint file {p}: field {key!r} is {info.get(key)!r}, expected {kind.__name__}"
            )
    return info


def _pids(info: dict[str, Any]) -> list[int]:
    """The processes an endpoint file names as its writers: the launcher, and the server, which
    may outlive a killed launcher and then still serves."""
    return [info[k] for k in ("launcher_pid", "pid") if isinstance(info.get(k), int)]


def read_endpoint(path: str | Path) -> Endpoint:
    """Read an endpoint file written by ``python -m agent serve`` (and the key it points to).

    Refuses a stale file at once: one written on this host whose launcher and server processes
    are all gone (a launcher killed with SIGKILL cannot remove it). From another host it cannot
    tell, and the health wait decides.
    """
    p = Path(path)
    info = read_info(p)
    pids = _pids(info)
    if info.get("hostname") == socket.gethostname() and pids and not any(map(_alive, pids)):
        raise EndpointError(
            f"endpoint file {p} is stale: written by {_writer(info)}, but no process of that "
            f"server runs any more (gone: pid {', '.join(map(str, pids))}), as when its launcher "
            f"is killed before it can remove the file; start the server again, which replaces it"
        )
    api_key = key_path = None
    if info.get("api_key_file"):
        key_path = Path(info["api_key_file"])
        key_path = key_path if key_path.is_absolute() else p.parent / key_path
        api_key = read_api_key(key_path)
    return Endpoint(
        url=info["url"],
        model=info["model"],
        api_key=api_key,
        max_model_len=info["max_model_len"],
        flags=list(info.get("flags") or []),
        path=p,
        info=info,
        key_file=key_path,
    )


def root_url(base_url: str) -> str:
    """``http://host:port`` from ``http://host:port/v1``."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def http_json(
    method: str,
    url: str,
    api_key: str | None = None,
    payload: dict[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> tuple[int, Any]:
    """One HTTP request with the standard library; returns (status, parsed JSON or text)."""
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, body = response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read().decode(errors="replace")
    try:
        return status, json.loads(body) if body else None
    except json.JSONDecodeError:
        return status, body


def probe(base_url: str, api_key: str | None = None, model: str | None = None) -> str | None:
    """None when /health answers 200 (and /v1/models lists ``model``), else what is missing;
    raises KeyRefused when /v1/models refuses ``api_key``."""
    try:
        status, _ = http_json("GET", root_url(base_url) + "/health", timeout_s=5)
        if status != 200:
            return f"/health answered {status}"
        if model is None:
            return None
        status, body = http_json("GET", root_url(base_url) + "/v1/models", api_key, timeout_s=5)
    except (OSError, urllib.error.URLError) as exc:
        return f"no answer ({getattr(exc, 'reason', exc)})"
    if status in (401, 403):
        raise KeyRefused(base_url, f"/v1/models answered {status}")
    if status != 200:
        return f"/v1/models answered {status}: {str(body)[:200]}"
    ids = [m.get("id") for m in (body or {}).get("data", [])] if isinstance(body, dict) else []
    return None if model in ids else f"/v1/models lists {ids}, not {model!r}"


# How long to wait for a server no launcher starts: a restart of a running one at most
UNLAUNCHED_WAIT_S = 30.0


def _launched(endpoint_file: str | Path) -> bool:
    """Whether the file names the launcher or server process that wrote it."""
    try:
        info = json.loads(Path(endpoint_file).read_text())
    except (OSError, ValueError):
        return True  # gone or torn: the launcher's own business, the full wait decides
    return isinstance(info, dict) and bool(_pids(info))


def wait_until_ready(
    base_url: str,
    api_key: str | None = None,
    model: str | None = None,
    timeout_s: float = 600.0,
    interval_s: float = 1.0,
    key_file: str | Path | None = None,
    endpoint_file: str | Path | None = None,
) -> float:
    """Block until the server is healthy (and serves ``model``); returns the seconds waited.

    Agents call this before their first request: a server in the same allocation may still be
    loading weights when the agent starts. A refused key ends the wait at once (KeyRefused);
    ``key_file`` and ``endpoint_file``, where the key and URL came from, are named in the errors.
    An endpoint file that names no launcher (written by hand for a running server) has no server
    starting behind it: that wait is cut to UNLAUNCHED_WAIT_S.
    """
    start = time.monotonic()
    unlaunched = endpoint_file is not None and not _launched(endpoint_file)
    if unlaunched:
        timeout_s = min(timeout_s, UNLAUNCHED_WAIT_S)
    while True:
        try:
            problem = probe(base_url, api_key, model)
        except KeyRefused as exc:
            raise KeyRefused(base_url, exc.answer, key_file, endpoint_file) from None
        waited = time.monotonic() - start
        if problem is None:
            return waited
        if waited >= timeout_s:
            where = f"; {describe(endpoint_file)}" if endpoint_file else ""
            if unlaunched:
                where += " (it names no launcher, so no server is starting: start it first)"
            raise EndpointError(
                f"server {base_url} not ready after {waited:.0f} s: {problem}{where}"
            )
        time.sleep(min(interval_s, max(0.0, timeout_s - waited)))


def describe(endpoint_file: str | Path) -> str:
    """What an endpoint file says now, and who wrote it: on another host a dead launcher cannot
    be told from a live one, so the user is given the host and job to look at."""
    try:
        info = read_endpoint(endpoint_file).info
    except EndpointError as exc:  # gone, stale, unreadable
        return str(exc)
    return f"endpoint file {endpoint_file} names {info['url']}, written by {_writer(info)}"

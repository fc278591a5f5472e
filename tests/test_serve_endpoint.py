"""Endpoint files, key files and the health wait, against a real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent.endpoint import (
    EndpointError,
    read_api_key,
    read_endpoint,
    root_url,
    wait_until_ready,
    write_endpoint,
)
from agent.record.durable import write_private


class _FakeVLLM(BaseHTTPRequestHandler):
    """/health answers once ``ready_at`` has passed; /v1/models wants the bearer key."""

    ready_at = 0.0
    key = "k"

    def do_GET(self):
        if self.path == "/health":
            self._send(200 if time.monotonic() >= self.ready_at else 503, b"")
        elif self.path == "/v1/models":
            if self.headers.get("Authorization") != f"Bearer {self.key}":
                self._send(401, b'{"error": "Unauthorized"}')
            else:
                self._send(200, json.dumps({"data": [{"id": "m1"}]}).encode())
        else:
            self._send(404, b"")

    def _send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_wait_until_ready_waits_for_health_then_the_model(fake_server):
    _FakeVLLM.ready_at = time.monotonic() + 1.5
    waited = wait_until_ready(fake_server, api_key="k", model="m1", timeout_s=20, interval_s=0.2)
    assert 1.2 < waited < 10


def test_wait_until_ready_times_out_with_the_reason(fake_server):
    _FakeVLLM.ready_at = 0.0
    with pytest.raises(
        EndpointError, match=r"not ready after \d+ s: /v1/models lists \['m1'\], not 'm2'"
    ):
        wait_until_ready(fake_server, api_key="k", model="m2", timeout_s=1, interval_s=0.2)
    with pytest.raises(EndpointError, match="/v1/models answered 401"):
        wait_until_ready(fake_server, api_key="wrong", model="m1", timeout_s=0.5, interval_s=0.2)


def test_wait_until_ready_on_a_closed_port():
    with pytest.raises(EndpointError, match="no answer"):
        wait_until_ready("http://127.0.0.1:9/v1", timeout_s=0.5, interval_s=0.1)


def test_read_endpoint_reads_the_key_file(tmp_path):
    write_private(tmp_path / "s.key", "secret\n")
    (tmp_path / "s.json").write_text(
        json.dumps(
            {
                "url": "http://h:1/v1",
                "model": "m",
                "max_model_len": 4096,
                "api_key_file": "s.key",
                "flags": [{"name": "--enable-prefix-caching"}],
            }
        )
    )
    ep = read_endpoint(tmp_path / "s.json")
    assert (ep.url, ep.model, ep.api_key, ep.max_model_len) == (
        "http://h:1/v1",
        "m",
        "secret",
        4096,
    )
    assert "secret" not in repr(ep)
    assert (tmp_path / "s.key").stat().st_mode & 0o777 == 0o600


def test_key_file_open_to_group_or_others_is_refused(tmp_path):
    key = tmp_path / "s.key"
    key.write_text("secret")
    for mode in (0o644, 0o620):  # readable by all; writable by the group
        key.chmod(mode)
        with pytest.raises(EndpointError) as err:
            read_api_key(key)
        assert str(err.value) == (
            f"API key file {key}: mode {mode:03o} gives group or others access to the key; "
            f"expected the owner's only (chmod 600 {key})"
        )
    key.chmod(0o600)
    assert read_api_key(key) == "secret"
    key.chmod(0o644)
    write_private(key, "secret")  # rewriting an existing file tightens its mode
    assert read_api_key(key) == "secret"


def test_bad_endpoint_files_name_the_field(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"url": "http://h:1/v1", "model": "m", "max_model_len": "4096"}))
    with pytest.raises(
        EndpointError, match=r"e.json: field 'max_model_len' is '4096', expected int"
    ):
        read_endpoint(path)
    with pytest.raises(EndpointError, match="No such file"):
        read_endpoint(tmp_path / "missing.json")


def test_root_url():
    assert root_url("http://h:8000/v1/") == "http://h:8000"
    assert root_url("http://h:8000") == "http://h:8000"


def test_what_the_launcher_writes_the_agents_read(tmp_path):
    """One owner of the format: write_endpoint's file reads back through read_endpoint, with the
    key from its 0600 file and never in the endpoint file itself."""
    key_file = tmp_path / "server.key"
    write_private(key_file, "s3cret\n")
    path = tmp_path / "server.json"
    flags = [{"layer": "prefix caching", "flag": "--enable-prefix-caching"}]
    write_endpoint(
        path, url="http://node1:8000/v1", model="m1", api_key_file=key_file,
        max_model_len=4096, flags=flags, vllm_version="0.32.0",
    )  # fmt: skip
    ep = read_endpoint(path)
    assert (ep.url, ep.model, ep.api_key, ep.max_model_len, ep.flags) == (
        "http://node1:8000/v1", "m1", "s3cret", 4096, flags,
    )  # fmt: skip
    assert ep.info["vllm_version"] == "0.32.0" and "s3cret" not in path.read_text()


def test_a_refused_key_ends_the_wait_at_once(fake_server, tmp_path):
    from agent.endpoint import KeyRefused, PolicyUnavailable

    _FakeVLLM.ready_at = 0.0
    key_file = tmp_path / "s.key"
    t0 = time.monotonic()
    with pytest.raises(KeyRefused) as err:
        wait_until_ready(fake_server, "wrong", "m1", timeout_s=60, key_file=key_file)
    assert time.monotonic() - t0 < 5
    assert str(err.value) == (
        f"server {fake_server} refused the API key in {key_file} (/v1/models answered 401): "
        "not the server's key; give the server's key file (--api-key-file)"
    )
    assert isinstance(err.value, PolicyUnavailable)  # the runner's one line and failed record


def test_endpoint_file_of_a_dead_launcher(tmp_path):
    """On this host it is refused at once as stale; from another host it cannot be told, and the
    wait's error names the file and its writer."""
    import os
    import socket
    import subprocess
    import sys

    key_file, path = tmp_path / "s.key", tmp_path / "s.json"
    write_private(key_file, "k\n")
    write = (
        "import sys; from agent.endpoint import write_endpoint; write_endpoint(sys.argv[1], "
        "url='http://127.0.0.1:9/v1', model='m1', api_key_file=sys.argv[2], max_model_len=4096, "
        "flags=[])"
    )
    env = {**os.environ, "SLURM_JOB_ID": "4242"}
    subprocess.run([sys.executable, "-c", write, str(path), str(key_file)], env=env, check=True)
    info = json.loads(path.read_text())
    pid, host = info["launcher_pid"], socket.gethostname()
    assert (info["hostname"], info["slurm_job_id"]) == (host, "4242") and pid != os.getpid()
    with pytest.raises(EndpointError) as err:
        read_endpoint(path)
    assert str(err.value) == (
        f"endpoint file {path} is stale: written by launcher pid {pid} on host {host}, Slurm job "
        f"4242, but no process of that server runs any more (gone: pid {pid}), as when its "
        "launcher is killed before it can remove the file; start the server again, which "
        "replaces it"
    )
    path.write_text(json.dumps({**info, "pid": os.getpid()}))  # a server outliving its launcher
    assert read_endpoint(path).url == "http://127.0.0.1:9/v1"
    path.write_text(json.dumps({**info, "hostname": "node7"}))
    with pytest.raises(EndpointError) as err:
        wait_until_ready(read_endpoint(path).url, timeout_s=0.3, interval_s=0.1, endpoint_file=path)
    assert str(err.value).endswith(
        f"; endpoint file {path} names http://127.0.0.1:9/v1, written by launcher pid {pid} on "
        "host node7, Slurm job 4242"
    )

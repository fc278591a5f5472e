"""A node's http_proxy must not capture the job's requests to a server in its own allocation.

Each check runs in a fresh interpreter: urllib builds its opener, proxies included, once per
process, so an earlier request in the test process would hide the proxy."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.fixtures_workflow import REPO

CHECK = """
import sys
from agent.endpoint import probe
if sys.argv[2] == "bypass":
    from agent.netenv import bypass_proxy_for_local
    bypass_proxy_for_local()
print("probe:", probe(sys.argv[1], model="tiny"))
if sys.argv[2] == "bypass":
    import openai
    client = openai.OpenAI(base_url=sys.argv[1], api_key="k", max_retries=0, timeout=10)
    print("models:", [m.id for m in client.models.list()])
"""


class _Server(BaseHTTPRequestHandler):
    """/health and /v1/models as vLLM answers them."""

    def do_GET(self) -> None:
        body = {"data": [{"id": "tiny", "object": "model"}], "object": "list"}
        data = json.dumps(body if self.path.startswith("/v1/models") else {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def local_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("0.0.0.0", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _run(base_url: str, mode: str) -> str:
    """CHECK in a fresh interpreter behind a proxy where nothing listens (connections refused),
    with a site's own NO_PROXY entry."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again when the block ends
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env |= {k: dead for k in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY")}
    env |= {"NO_PROXY": "example.org", "no_proxy": "example.org"}
    out = subprocess.run(
        [sys.executable, "-c", CHECK, base_url, mode],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_dead_proxy_breaks_the_probe_without_the_bypass(local_server: int):
    out = _run(f"http://127.0.0.1:{local_server}/v1", "plain")  # the case the fix is for
    assert "probe: None" not in out and "no answer" in out, out


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", socket.gethostname()])
def test_health_probe_and_openai_client_bypass_the_proxy_for_local_names(
    local_server: int, host: str
):
    out = _run(f"http://{host}:{local_server}/v1", "bypass")
    assert "probe: None" in out and "models: ['tiny']" in out, out


def test_the_bypass_keeps_the_sites_entries(monkeypatch: pytest.MonkeyPatch):
    from agent.netenv import bypass_proxy_for_local

    monkeypatch.setenv("NO_PROXY", "example.org")
    monkeypatch.setenv("no_proxy", "example.org")
    bypass_proxy_for_local()
    for key in ("NO_PROXY", "no_proxy"):
        entries = os.environ[key].split(",")
        assert entries[0] == "example.org" and {"127.0.0.1", "localhost"} <= set(entries)

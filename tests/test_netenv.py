"""A node's http_proxy must not capture the job's requests to a server in its own allocation."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from agent.endpoint import probe
from agent.netenv import bypass_proxy_for_local


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
def local_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("0.0.0.0", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def dead_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy address where nothing listens, as a node whose proxy cannot reach it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections to it are refused
    for key in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.setenv(key, f"http://127.0.0.1:{port}")
    for key in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(key, "example.org")  # a site's own entry, which must be kept


def test_dead_proxy_breaks_the_probe_without_the_bypass(dead_proxy: None, local_server: str):
    assert probe(f"http://127.0.0.1:{local_server}/v1") is not None  # the case the fix is for


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", socket.gethostname()])
def test_health_probe_and_openai_client_bypass_the_proxy_for_local_names(
    dead_proxy: None, local_server: str, host: str
):
    bypass_proxy_for_local()
    assert os.environ["no_proxy"].startswith("example.org,")  # the site's entry first, kept
    base_url = f"http://{host}:{local_server}/v1"
    assert probe(base_url, model="tiny") is None
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=10)
    assert [m.id for m in client.models.list()] == ["tiny"]

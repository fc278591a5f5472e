"""Metrics files as kills and restarts leave them: a sample's rows cut by a kill, then the resumed
run's rows; a server's last row cut, then a restarted server's; stray lines; and a server that
answers `serve status` one byte at a time."""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import time

import pytest

from agent.record.collect import load_sample
from agent.record.durable import read_appended_rows
from agent.record.world_state import WorldState
from agent.report.performance import build
from agent.serve import metrics, status
from tests.test_serve_metrics import exposition, llm_sample, shard_file, started


def cut(line: bytes) -> bytes:
    """A row as a kill leaves it: its first half, no newline."""
    return line[: len(line) // 2]


def test_a_row_cut_by_a_kill_hides_no_later_row(tmp_path):
    """A run killed while writing row 11, resumed: its 14 rows go after the cut one (the first on
    the cut line's end). Every whole row is read, and the report counts them."""
    lines = [
        json.dumps({"step": i, "tools": ["qc"], "time": 100.0 + i}).encode() for i in range(1, 26)
    ]
    body = b"\n".join(lines[:10]) + b"\n" + cut(lines[10]) + lines[11] + b"\n"
    body += b"\n".join(lines[12:]) + b"\n"
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "metrics.jsonl").write_bytes(body)
    (folder / "world_state.json").write_bytes(WorldState(meta={"sample": "s"}).to_json())
    rows = read_appended_rows(folder / "metrics.jsonl")
    assert [r["step"] for r in rows] == [*range(1, 11), *range(12, 26)]
    assert len(load_sample(folder / "world_state.json").metrics) == 24


def test_stray_lines_are_skipped_not_fatal(tmp_path):
    """A `null` line, a row without `time`, a list: no row of a metrics file; the report's
    performance section and `serve status` read the rows around them."""
    path = shard_file(tmp_path, 0.9, starts=(0,))
    whole = path.read_bytes()
    path.write_bytes(b"null\n" + b'{"started": "x"}\n' + b"[1, 2]\n" + whole)
    assert len(read_appended_rows(path)) == 3
    [shard] = build([llm_sample("s1", 900, server=started(0), times=(10, 20))], [path]).shards
    assert shard.figures["preemptions"] == 3


def test_a_server_restarted_after_a_cut_row_is_the_newest(tmp_path):
    """The first server killed while its sampler wrote a row; the retried job's server appends:
    its rows are read, so the report shows the new server, not the killed one."""
    path = shard_file(tmp_path, 0.9, starts=(0, 600))
    first, second = (
        path.read_bytes().splitlines(keepends=True)[:3],
        path.read_bytes().splitlines(keepends=True)[3:],
    )
    path.write_bytes(b"".join(first[:2]) + cut(first[2]) + b"".join(second))
    by_server = metrics.servers(read_appended_rows(path))
    assert list(by_server) == [started(0), started(600)]
    assert [len(rows) for rows in by_server.values()] == [2, 3]
    shards = build([llm_sample("s3", 900, times=(610,))], [path]).shards
    assert [sorted(metrics.servers(s.rows)) for s in shards] == [[started(600)]]


class Server(http.server.BaseHTTPRequestHandler):
    """/health and /metrics at once, or with ``trickle`` /metrics one byte every half second
    (each read well within urllib's timeout, so only an overall deadline ends the wait)."""

    def do_GET(self) -> None:
        body = exposition(10, 5, 0, 0, [0.2]).encode()
        trickle = self.server.trickle and self.path == "/metrics"
        self.send_response(200)
        self.send_header("Content-Length", str(10**6 if trickle else len(body)))
        self.end_headers()
        for byte in body[:40] if trickle else [body]:
            self.wfile.write(bytes([byte]) if trickle else byte)
            self.wfile.flush()
            time.sleep(0.5 if trickle else 0)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(tmp_path):
    """A local HTTP server (``.trickle`` False) and its endpoint file (``.endpoint``)."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Server)
    httpd.daemon_threads, httpd.trickle = True, False
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    httpd.endpoint = tmp_path / "shard000.json"
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.endpoint.write_text(json.dumps({"url": url, "started_at": started(0)}))
    yield httpd
    httpd.shutdown()


def test_status_reads_past_stray_lines(server, capsys):
    path = metrics.metrics_path(server.endpoint)
    row = {
        "time": time.time() - 10,
        "started": started(0),
        **metrics.parse(exposition(0, 0, 0, 0, [])),
    }
    path.write_text(f"null\n{json.dumps({'started': started(0)})}\n{json.dumps(row)}\n")
    args = argparse.Namespace(endpoint=server.endpoint, json=True, action="status")
    assert status.main(args) == 0
    assert json.loads(capsys.readouterr().out)["figures"]["generation_tokens_per_s"] == 0


def test_status_of_a_server_that_trickles_ends_at_its_deadline(server, monkeypatch, capsys):
    server.trickle = True
    monkeypatch.setattr(status, "DEADLINE_S", 2.0)
    args = argparse.Namespace(endpoint=server.endpoint, json=False, action="status")
    t0 = time.monotonic()
    assert status.main(args) == 1
    assert time.monotonic() - t0 < 5
    assert "no whole answer within 2 s" in capsys.readouterr().err

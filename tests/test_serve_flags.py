"""Flag selection for H100, A100, H200 and cpu descriptions, with and without MTP heads."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.serve import gpu as gpus
from agent.serve.flags import select_flags
from agent.serve.model_config import load_model_config

CONFIGS = Path(__file__).parent / "data" / "model_configs"
QWEN3_8B = load_model_config(CONFIGS / "qwen3-8b.json")
DEEPSEEK_V3 = load_model_config(CONFIGS / "deepseek-v3.json")
GEMMA4 = load_model_config(CONFIGS / "gemma-4-31b-it.json")
QWEN36 = load_model_config(CONFIGS / "qwen3.6-27b.json")


def flag(plan, name):
    found = [f for f in plan.flags if f.name == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def test_h100_switches_on_all_four_layers_it_can():
    plan = select_flags(gpus.preset("H100-80GB"), QWEN3_8B, {"agents": 12})
    argv = plan.argv()
    assert "--enforce-eager" not in argv
    assert flag(plan, "--max-cudagraph-capture-size").value == "16"  # 12 agents -> sizes up to 16
    assert argv[argv.index("--quantization") + 1] == "fp8_per_tensor"  # vLLM 0.32's online FP8
    assert "cc 9.0 >= 8.9" in flag(plan, "--quantization").reason
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    assert not flag(plan, "--speculative-config").chosen
    assert "declares no MTP heads" in flag(plan, "--speculative-config").reason
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert argv[argv.index("--tool-strict-level") + 1] == "parameter"
    assert "--enable-auto-tool-choice" in argv and "--chat-template" not in argv
    assert plan.family.name == "qwen3"
    assert argv[argv.index("--max-num-seqs") + 1] == "12"
    assert int(argv[argv.index("--max-model-len") + 1]) == plan.plan.max_model_len
    assert "--tensor-parallel-size" not in argv and plan.environment() == {}


def test_a100_gets_fp8_kv_cache_but_no_fp8_weights():
    plan = select_flags(gpus.preset("A100-80GB"), QWEN3_8B)
    weights, kv = flag(plan, "--quantization"), flag(plan, "--kv-cache-dtype")
    assert not weights.chosen and "cc 8.0 < 8.9" in weights.reason
    assert kv.chosen and kv.value == "fp8"
    assert "--quantization" not in plan.argv()
    assert plan.plan.weight_dtype == "bf16" and plan.plan.kv_dtype == "fp8"


def test_fp8_kv_reason_quotes_the_capacity_it_buys():
    plan = select_flags(gpus.preset("A100-40GB"), QWEN3_8B, {"agents": 4})
    reason = flag(plan, "--kv-cache-dtype").reason
    length = plan.plan.max_model_len
    assert f"{plan.plan.seqs_fit(length)} sequences of {length:,} tokens fit instead of" in reason


def test_h200_with_mtp_heads_gets_mtp_speculation_and_tensor_parallelism():
    plan = select_flags(gpus.resolve("H200-141GB", 8), DEEPSEEK_V3)
    spec = flag(plan, "--speculative-config")
    # one MTP head, drafted 2 deep as the catalogue's deepseek_v3 recipe says
    assert spec.chosen and json.loads(spec.value) == {"method": "mtp", "num_speculative_tokens": 2}
    assert "declares 1 MTP head" in spec.reason and "deepseek_v3 recipe" in spec.reason
    # 8 agents x (1 + 2 draft tokens) = 24 tokens per decode step must fit the captured graphs
    assert flag(plan, "--max-cudagraph-capture-size").value == "24"
    assert flag(plan, "--tensor-parallel-size").value == "8"
    weights = flag(plan, "--quantization")  # the checkpoint is FP8 already: no dynamic quantization
    assert not weights.chosen and "already FP8" in weights.reason
    assert flag(plan, "--tool-call-parser").value == "deepseek_v3"
    assert plan.plan.weight_dtype == "fp8"


def test_mtp_declared_as_mtp_num_hidden_layers_counts_too():
    config = {**QWEN3_8B, "mtp_num_hidden_layers": 2}
    plan = select_flags(gpus.preset("H100-80GB"), config, {"num_speculative_tokens": 4})
    assert json.loads(flag(plan, "--speculative-config").value) == {
        "method": "mtp",
        "num_speculative_tokens": 4,
    }
    # no recipe in the qwen3 family: one draft token per declared head
    plain = select_flags(gpus.preset("H100-80GB"), config)
    assert json.loads(flag(plain, "--speculative-config").value)["num_speculative_tokens"] == 2


def test_cpu_leaves_out_what_needs_a_gpu_with_reasons():
    plan = select_flags(gpus.cpu(2), DEEPSEEK_V3 | {"quantization_config": None}, {"agents": 2})
    argv = plan.argv()
    for name in (
        "--enforce-eager",
        "--quantization",
        "--kv-cache-dtype",
        "--speculative-config",
        "--tensor-parallel-size",
        "--gpu-memory-utilization",
    ):
        assert name not in argv
        assert flag(plan, name).reason.startswith("cpu")
    assert "MTP" in flag(plan, "--speculative-config").reason
    assert "--enable-prefix-caching" in argv  # prefix caching works on CPU too
    # whole prompts in one step: the CPU worker dies on chunked prefill of a seeded request
    batched = argv[argv.index("--max-num-batched-tokens") + 1]
    assert batched == argv[argv.index("--max-model-len") + 1]
    assert plan.environment() == {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def test_overrides_switch_layers_off_and_on():
    h100 = gpus.preset("H100-80GB")
    plan = select_flags(
        h100,
        QWEN3_8B,
        {
            "enforce_eager": True,
            "quantization": "none",
            "kv_cache_dtype": "model",
            "prefix_caching": False,
            "speculative": "ngram",
        },
    )
    argv = plan.argv()
    assert "--enforce-eager" in argv and "--max-cudagraph-capture-size" not in argv
    assert "--quantization" not in argv and "--kv-cache-dtype" not in argv
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert json.loads(flag(plan, "--speculative-config").value)["method"] == "ngram"
    a100 = select_flags(gpus.preset("A100-80GB"), QWEN3_8B, {"quantization": "fp8"})
    assert (
        flag(a100, "--quantization").chosen
        and "asked by config" in flag(a100, "--quantization").reason
    )


def test_bad_overrides_name_the_key():
    h100 = gpus.preset("H100-80GB")
    with pytest.raises(
        ValueError, match=r"quantisation: Extra inputs are not permitted.*allowed keys"
    ):
        select_flags(h100, QWEN3_8B, {"quantisation": "fp8"})
    with pytest.raises(ValueError, match=r"speculative: Input should be"):
        select_flags(h100, QWEN3_8B, {"speculative": "eagle"})
    with pytest.raises(ValueError, match="declares no MTP heads"):
        select_flags(h100, QWEN3_8B, {"speculative": "mtp"})
    with pytest.raises(ValueError, match="32 attention heads do not split over 3 GPUs"):
        select_flags(gpus.resolve("H100-80GB", 3), QWEN3_8B)
    with pytest.raises(ValueError, match=r"model family 'qwen9' is not in the catalogue; known"):
        select_flags(h100, QWEN3_8B, {"family": "qwen9"})
    heads3 = {**DEEPSEEK_V3, "num_nextn_predict_layers": 3}
    with pytest.raises(ValueError, match="must be a multiple of 3"):
        select_flags(gpus.resolve("H200-141GB", 8), heads3, {"num_speculative_tokens": 4})


def test_fp8_kv_leaves_gemma4s_sliding_layers_at_the_models_dtype():
    skip = flag(select_flags(gpus.preset("H100-80GB"), GEMMA4), "--kv-cache-dtype-skip-layers")
    assert skip.chosen and skip.value == "sliding_window" and "1,024 tokens" in skip.reason
    # no FP8 KV cache, or no sliding layers (Qwen3.6): nothing to skip
    for config, overrides in ((GEMMA4, {"kv_cache_dtype": "model"}), (QWEN36, {})):
        plan = select_flags(gpus.preset("H100-80GB"), config, overrides)
        assert "--kv-cache-dtype-skip-layers" not in {f.name for f in plan.flags}


def test_a_published_fp8_checkpoint_replaces_online_quantisation_where_fp8_weights_pay():
    h100 = select_flags(gpus.preset("H100-80GB"), QWEN36, model_id="Qwen/Qwen3.6-27B")
    assert h100.checkpoint() == "Qwen/Qwen3.6-27B-FP8"
    assert "publisher" in flag(h100, "checkpoint").reason
    assert not flag(h100, "--quantization").chosen and "checkpoint" not in h100.argv()
    # no FP8 tensor cores, asked not to, or a model the catalogue knows no checkpoint of
    for gpu, overrides, model_id in (
        ("A100-80GB", {}, "Qwen/Qwen3.6-27B"),
        ("H100-80GB", {"fp8_checkpoint": False}, "Qwen/Qwen3.6-27B"),
        ("H100-80GB", {}, "someone/Qwen3.6-27B-finetune"),
    ):
        plan = select_flags(gpus.preset(gpu), QWEN36, overrides, model_id=model_id)
        assert plan.checkpoint() is None
    assert flag(plan, "--quantization").chosen  # online FP8 for the fine-tune


def test_a_drafter_from_the_catalogue_or_the_overrides_drafts_for_the_model():
    plan = select_flags(gpus.preset("H100-80GB"), GEMMA4, model_id="google/gemma-4-31B-it")
    spec = json.loads(flag(plan, "--speculative-config").value)
    assert spec == {
        "method": "mtp", "model": "google/gemma-4-31B-it-assistant", "num_speculative_tokens": 1
    }  # fmt: skip
    assert plan.chosen("--max-cudagraph-capture-size").value == "16"  # 8 agents x (1 + 1)
    given = select_flags(
        gpus.preset("H100-80GB"), QWEN3_8B, {"draft_model": "/m/qwen3-0.6b"}, model_id="x"
    )
    spec = json.loads(flag(given, "--speculative-config").value)
    assert spec == {"model": "/m/qwen3-0.6b", "num_speculative_tokens": 1}  # vLLM tells the method
    assert "asked by config" in flag(given, "--speculative-config").reason
    # a checkpoint the catalogue names no drafter for
    assert not flag(select_flags(gpus.preset("H100-80GB"), GEMMA4), "--speculative-config").chosen


def test_unknown_family_leaves_tool_calling_out_with_a_reason():
    mystery = {**QWEN3_8B, "model_type": "mystery", "architectures": ["MysteryForCausalLM"]}
    plan = select_flags(gpus.preset("L40S"), mystery)
    assert plan.family is None
    reason = flag(plan, "--enable-auto-tool-choice").reason
    assert not flag(plan, "--enable-auto-tool-choice").chosen
    assert "matches model_type mystery" in reason and "family=NAME" in reason
    assert flag(plan, "--quantization").chosen  # L40S is cc 8.9: FP8 tensor cores
    # a family named in the overrides serves it anyway (a tiny test model with another template)
    forced = select_flags(gpus.preset("L40S"), mystery, {"family": "gemma3"})
    assert flag(forced, "--tool-call-parser").value == "pythonic"
    assert flag(forced, "--chat-template").value.endswith(
        "tool_chat_template_gemma3_pythonic.jinja"
    )


def test_selection_is_pure():
    a = select_flags(gpus.preset("H100-80GB"), QWEN3_8B, {"agents": 4}).to_dict()
    b = select_flags(gpus.preset("H100-80GB"), QWEN3_8B, {"agents": 4}).to_dict()
    assert a == b and json.loads(json.dumps(a)) == a


@pytest.mark.parametrize("gpu", ["H100-80GB", "A100-80GB"])
def test_serve_explain_prints_four_layers_with_reasons(gpu):
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "serve",
        "--explain",
        "--gpu",
        gpu,
        "--model-config",
        str(CONFIGS / "qwen3-8b.json"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for title in (
        "Layer 1 - CUDA graphs",
        "Layer 2 - FP8",
        "Layer 3 - prefix caching",
        "Layer 4 - speculative",
    ):
        assert title in out
    assert (
        "+ --quantization fp8_per_tensor"
        if gpu.startswith("H100")
        else "- --quantization fp8_per_tensor"
    ) in out
    assert "+ --kv-cache-dtype fp8" in out
    assert "arguments: " in out


_PARSE_WITH_VLLM = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
for argv in json.loads(sys.argv[1]):
    args = parser.parse_args(["--model", "m", *argv])
    validate_parsed_serve_args(args)
    print(json.dumps(vars(args), default=str))
"""


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_own_parser_accepts_the_gpu_flags():
    """The GPU flags cannot run here, but vLLM's own argument parser checks their names and values."""
    h200 = select_flags(gpus.resolve("H200-141GB", 8), DEEPSEEK_V3, {"agents": 12}).argv()
    h100 = select_flags(gpus.preset("H100-80GB"), QWEN3_8B).argv()
    gemma = select_flags(gpus.preset("H100-80GB"), GEMMA4, model_id="google/gemma-4-31B-it").argv()
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_WITH_VLLM, json.dumps([h200, h100, gemma])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    deepseek, qwen, gemma = (json.loads(x) for x in done.stdout.strip().splitlines()[-3:])
    assert gemma["kv_cache_dtype_skip_layers"] == ["sliding_window"]
    assert gemma["speculative_config"]["model"] == "google/gemma-4-31B-it-assistant"
    assert deepseek["kv_cache_dtype"] == "fp8" and deepseek["tensor_parallel_size"] == 8
    assert deepseek["max_cudagraph_capture_size"] == 40 and deepseek["max_num_seqs"] == 12
    assert deepseek["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert (
        deepseek["tool_call_parser"] == "deepseek_v3" and deepseek["enable_prompt_tokens_details"]
    )
    assert qwen["quantization"] == "fp8_per_tensor" and qwen["tool_strict_level"] == "parameter"
    assert qwen["reasoning_parser"] == "qwen3"

"""Real models as shipped, without weights: Hub ids resolved offline from a Hugging Face cache layout
holding the published config.json of Qwen3.6-27B and Gemma-4-31B-it, the flags `agent serve
--explain` prints for them on H100, A100 and H200, and vLLM 0.32's own `vllm serve` parser
accepting the launcher's argument list for every family on every preset."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.serve import gpu as gpus
from agent.serve import hub, kvplan_text, launch
from agent.serve.flags import select_flags
from agent.serve.model_config import load_model_config

CONFIGS = Path(__file__).parent / "data" / "model_configs"
REVISION = "0123456789abcdef0123456789abcdef01234567"
HUB_MODELS = {"Qwen/Qwen3.6-27B": "qwen3.6-27b", "google/gemma-4-31B-it": "gemma-4-31b-it"}


def add_to_cache(hub_dir: Path, repo_id: str, config_file: str, revision: str = REVISION) -> Path:
    """huggingface_hub's layout: models--ORG--NAME/snapshots/<commit>/ and refs/main."""
    repo = hub_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    shutil.copy(CONFIGS / f"{config_file}.json", snapshot / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf"
    for repo_id, file in HUB_MODELS.items():
        add_to_cache(home / "hub", repo_id, file)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def explain(model: str, gpu: str, hf_home: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "agent", "serve", "--explain", "--model", model, "--gpu", gpu]
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=120)


def test_hub_id_resolves_offline_to_its_snapshot(hf_home):
    found = hub.resolve("Qwen/Qwen3.6-27B")
    assert found.revision == REVISION and found.model_id == "Qwen/Qwen3.6-27B"
    assert found.path == hf_home / "hub/models--Qwen--Qwen3.6-27B/snapshots" / REVISION
    assert hub.resolve("Qwen/Qwen3.6-27B", revision=REVISION).path == found.path


def test_a_missing_model_says_where_it_looked_and_how_to_fetch_it(hf_home, tmp_path):
    with pytest.raises(hub.ModelNotFound) as err:
        hub.resolve("Qwen/Qwen3-8B")
    message = str(err.value)
    assert f"not in the Hugging Face cache {hf_home / 'hub'}" in message
    assert f"HF_HOME={hf_home} hf download Qwen/Qwen3-8B --revision main" in message
    with pytest.raises(hub.ModelNotFound, match="revision v2"):
        hub.resolve("Qwen/Qwen3.6-27B", revision="v2")
    with pytest.raises(hub.ModelNotFound, match="no such directory"):
        hub.resolve(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(hub.ModelNotFound, match=r"has no config\.json"):
        hub.resolve(str(tmp_path / "empty"))


def test_a_directory_is_used_as_it_is(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    shutil.copy(CONFIGS / "qwen3-8b.json", model / "config.json")
    found = hub.resolve(str(model))
    assert (found.path, found.revision) == (model, None)


@pytest.mark.parametrize("gpu", ["H100", "A100", "H200"])
def test_explain_qwen36_27b_from_the_hub_cache(hf_home, gpu):
    done = explain("Qwen/Qwen3.6-27B", gpu, hf_home)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"model: Qwen/Qwen3.6-27B at revision {REVISION}" in out
    assert "model family: qwen3.5" in out
    assert "+ --tool-call-parser qwen3_coder" in out and "+ --reasoning-parser qwen3" in out
    assert "+ --tool-strict-level parameter" in out and "+ --language-model-only" in out
    assert '+ --speculative-config {"method":"mtp","num_speculative_tokens":2}' in out
    # 16 full-attention layers x 4 KV heads x 256 x 2 (K, V): 65,536 B/token in bf16, half in fp8
    assert "32,768 B/token (fp8) in 16 full-attention layers" in out
    assert "16 full layers x 4 KV heads x 256 head dim" in out
    # FP8 weights where they pay: Qwen's published FP8 checkpoint, not online quantisation
    fp8_weights = "+ checkpoint Qwen/Qwen3.6-27B-FP8" if gpu != "A100" else "- --quantization"
    assert fp8_weights in out and "- --quantization" in out and "+ --kv-cache-dtype fp8" in out
    # 8 agents x (1 + 2 draft tokens)
    assert "+ --max-cudagraph-capture-size 24" in out
    # prefix caching and 2 drafted tokens: vLLM keeps 4 states of the 48 linear layers, and
    # the MTP layer's KV beside the 16 full-attention layers
    assert "4 x 148.7 MiB of linear-attention state per sequence (prefix caching" in out
    assert "the same per token in 1 MTP layer(s), which keep KV while drafting 2" in out


@pytest.mark.parametrize("gpu", ["H100", "A100", "H200"])
def test_explain_gemma4_31b_from_the_hub_cache(hf_home, gpu):
    done = explain("google/gemma-4-31B-it", gpu, hf_home)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "model family: gemma4" in out
    assert "+ --tool-call-parser gemma4" in out and "+ --reasoning-parser gemma4" in out
    # the gemma4 parser builds no structural tag: no strict level is claimed
    assert "- --tool-strict-level" in out and "builds no structural tag" in out
    # no MTP heads in the config: Google's assistant checkpoint drafts, through vLLM's MTP path
    drafter = (
        '{"method":"mtp","model":"google/gemma-4-31B-it-assistant","num_speculative_tokens":1}'
    )
    assert f"+ --speculative-config {drafter}" in out
    assert "+ --kv-cache-dtype-skip-layers sliding_window" in out  # FP8 KV on all three
    # global layers: 10 x 4 KV heads x 512 x 2 x 1 B (fp8); sliding ones only hold 1024 tokens
    assert "40,960 B/token (fp8) in 10 full-attention layers" in out
    # vLLM reserves a window less one plus two batches in flight (its default batch per GPU)
    in_flight = {"H100": 16384, "A100": 4096, "H200": 16384}[gpu]
    assert f"(window 1,024 - 1 + {in_flight:,} tokens in flight)" in out


def test_a_drafter_not_fetched_is_refused_before_any_server_starts(hf_home, tmp_path):
    """--explain plans Gemma 4's assistant with a stand-in; serving needs its files, which vLLM
    reads offline as the model's: the launcher names the drafter and how to fetch it, exit 2."""
    endpoint = tmp_path / "server.json"
    serve = [sys.executable, "-m", "agent", "serve", "--model", "google/gemma-4-31B-it"]
    served = subprocess.run(
        [*serve, "--gpu", "H100", "--endpoint-file", str(endpoint)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert served.returncode == 2 and not endpoint.exists()
    assert "drafter google/gemma-4-31B-it-assistant" in served.stderr
    assert "hf download google/gemma-4-31B-it-assistant" in served.stderr


def test_gemma4_kv_plan_counts_global_layers_and_windows():
    config = load_model_config(CONFIGS / "gemma-4-31b-it.json")
    plan = select_flags(gpus.preset("H100"), config, {"kv_cache_dtype": "model"}).plan
    s = plan.shape
    assert s.count("full") * s.kv_bytes_per_token_per_layer(2, "full") == 81_920
    per_sequence = s.sequence_bytes(32_768, 2)  # the window alone, nothing in flight
    assert per_sequence == 81_920 * 32_768 + 50 * 2 * 16 * 256 * 2 * 1024
    in_flight = plan.sequence_bytes(32_768) - per_sequence  # two batches of 8192 on an H100
    assert in_flight == 50 * 2 * 16 * 256 * 2 * (1024 - 1 + 16384 - 1024)
    # the old planner's 16 heads x 256 everywhere would have cost far more per sequence
    assert per_sequence < 60 * 2 * 16 * 256 * 2 * 32_768 / 5


def test_fp8_weights_keep_embeddings_and_the_vision_tower_in_bf16():
    config = load_model_config(CONFIGS / "gemma-4-31b-it.json")
    h100 = gpus.preset("H100")
    fp8 = select_flags(h100, config).plan
    shape = fp8.shape
    kept = shape.embedding_params()  # --language-model-only: the vision tower is not loaded
    assert fp8.weights_gib * 1024**3 == pytest.approx((fp8.params - kept) * 1 + kept * 2)
    multimodal = select_flags(h100, config, {"family": "qwen3"}).plan  # keeps its vision tower
    assert multimodal.params - fp8.params == shape.vision_params > 0.5e9


def test_kv_heads_are_replicated_when_gpus_outnumber_them():
    config = load_model_config(CONFIGS / "qwen3.6-27b.json")
    one = select_flags(gpus.resolve("H100", 1), config, {"kv_cache_dtype": "model"}).plan
    eight = select_flags(gpus.resolve("H100", 8), config, {"kv_cache_dtype": "model"}).plan
    assert one.kv_bytes_per_token == 65_536
    assert eight.kv_bytes_per_token == 65_536 * 2  # 4 KV heads over 8 GPUs: each GPU holds one
    assert "8 (replicated 4) KV heads" in kvplan_text.per_token_formula(eight)


def test_launcher_options_reach_the_server_environment(tmp_path):
    args = argparse.Namespace(cache_dir=tmp_path / "vllm-cache")
    plan = select_flags(gpus.cpu(2), load_model_config(CONFIGS / "qwen3-8b.json"), {"agents": 2})
    env = launch.server_environment(args, plan, "key")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache")
    assert env["VLLM_API_KEY"] == "key" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env.get("HF_HUB_OFFLINE") == os.environ.get("HF_HUB_OFFLINE", "1")


def test_a_taken_port_is_recognised_in_the_new_part_of_the_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("earlier start\nOSError: [Errno 98] Address already in use\n")
    offset = log.stat().st_size
    assert launch.bind_failed(log, 0) and not launch.bind_failed(log, offset)
    with open(log, "a") as f:
        f.write("ERROR: [Errno 98] error while attempting to bind on address: address in use\n")
    assert launch.bind_failed(log, offset)


FAMILY_CONFIGS = {
    "qwen2": "qwen2.5-7b",
    "qwen3": "qwen3-8b",
    "qwen3-next": "qwen3-next-80b-a3b-instruct",
    "qwen3.5": "qwen3.6-27b",
    "gemma3": "gemma-3-12b-it",
    "gemma4": "gemma-4-31b-it",
    "llama3": "llama-3.1-8b-instruct",
    "deepseek_v3": "deepseek-v3",
}
PRESETS = ("H100", "A100", "H200")
# GPUs the weights need where one is not enough (DeepSeek-V3 on 80 GB GPUs: two nodes)
GPUS = {("deepseek_v3", "A100"): 16, ("deepseek_v3", "H100"): 16, ("deepseek_v3", "H200"): 8}
GPUS |= {("qwen3-next", g): 4 for g in PRESETS}


def launcher_argv(family: str, gpu: str) -> list[str]:
    """The argument list `agent serve` gives `vllm serve` (after `python -m MODULE serve`)."""
    config = load_model_config(CONFIGS / f"{FAMILY_CONFIGS[family]}.json")
    plan = select_flags(gpus.resolve(gpu, GPUS.get((family, gpu), 1)), config, {"agents": 8})
    assert plan.family is not None and plan.family.name == family
    args = argparse.Namespace(host="127.0.0.1", port=0, extra_arg=[])
    command = launch.vllm_command(Path("/models") / family, cli=True)  # as on a GPU build
    argv = launch.vllm_argv(command, launch.server_flags(args, family, 8000, Path("k")), plan, [])
    assert argv[1:4] == ["-m", launch.VLLM_CLI, "serve"]
    return argv[4:]


_PARSE_LIKE_VLLM_SERVE = """
import json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
cases = json.loads(sys.argv[1])
# `vllm serve`, as vllm/entrypoints/cli/main.py builds it
parser = FlexibleArgumentParser(description="vLLM CLI")
subparsers = parser.add_subparsers(required=False, dest="subparser")
serve = ServeSubcommand()
serve.subparser_init(subparsers)
for argv in cases["cli"]:
    args = parser.parse_args(["serve", *argv])
    serve.validate(args)
    print(json.dumps(vars(args), default=str))
# the CPU build's single-server entry, as vllm/entrypoints/launchers/api_server/entry.py builds it
server = make_arg_parser(FlexibleArgumentParser())
for argv in cases["server"]:
    args = server.parse_args(argv)
    validate_parsed_serve_args(args)
    print(json.dumps(vars(args), default=str))
"""


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_serve_parser_accepts_every_family_on_every_preset():
    """vLLM's own `vllm serve` parser and validation, built as vllm/entrypoints/cli/main.py does."""
    cases = [(f, g) for f in FAMILY_CONFIGS for g in PRESETS]
    argvs = [launcher_argv(f, g) for f, g in cases]
    cpu_plan = select_flags(
        gpus.cpu(2), load_model_config(CONFIGS / "qwen3-8b.json"), {"agents": 2}
    )
    cpu_argv = launch.vllm_argv(launch.vllm_command(Path("/models/q"), cli=False), [], cpu_plan, [])
    assert cpu_argv[1:5] == ["-m", launch.VLLM_SERVER, "--model", "/models/q"]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _PARSE_LIKE_VLLM_SERVE,
            json.dumps({"cli": argvs, "server": [cpu_argv[3:]]}),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *parsed, cpu = [
        json.loads(line) for line in done.stdout.strip().splitlines()[-len(cases) - 1 :]
    ]
    assert cpu["model"] == "/models/q" and cpu["reasoning_parser"] == "qwen3"
    for (family, gpu), args in zip(cases, parsed, strict=True):
        assert args["model_tag"] == f"/models/{family}", (family, gpu)
        assert (
            args["tool_call_parser"]
            == launcher_argv(family, gpu)[
                launcher_argv(family, gpu).index("--tool-call-parser") + 1
            ]
        )
        assert args["enable_auto_tool_choice"] and args["enable_prefix_caching"]
    by_case = dict(zip(cases, parsed, strict=True))
    qwen36 = by_case[("qwen3.5", "H100")]
    assert qwen36["reasoning_parser"] == "qwen3" and qwen36["language_model_only"]
    assert qwen36["quantization"] == "fp8_per_tensor"
    assert qwen36["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert qwen36["max_cudagraph_capture_size"] == 24
    assert by_case[("gemma3", "A100")]["chat_template"].endswith("gemma3_pythonic.jinja")
    assert by_case[("gemma4", "H200")]["tool_strict_level"] == "auto"  # vLLM's default, not ours

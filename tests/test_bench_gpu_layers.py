"""bench/gpu/layers.py on CPU, so that the GPU script cannot rot: one layer's figures measured
against the session's vLLM server, the ladder's skips where a CPU has no such layer."""

import pytest

from agent.record.world_state import WorldState
from agent.serve.flags import select_flags
from agent.serve.gpu import resolve
from bench import _script
from bench.gpu import layers

STEPS = 3


@pytest.mark.vllm
def test_one_layer_measured_as_the_gpu_table_shows_it(vllm_server, demo_run, tmp_path):
    """An agent session scripted from a real record: iteration latency, TTFT of the first
    (cold) and later (warm) steps from the server's per-request timing, cached share, and no
    MTP figures on a server without speculation; the table's row from them."""
    entries = _script.script(WorldState.load(demo_run.world_state), STEPS)
    f = layers.measure(
        vllm_server.base_url, vllm_server.model, vllm_server.api_key,
        vllm_server.max_model_len, entries, 8, tmp_path,
    )  # fmt: skip
    assert f.status == "finished"
    assert f.ttft_cold_ms > 0 and f.ttft_warm_ms > 0
    assert 0 < f.cached < 1  # the later steps reuse the first one's prefix
    assert f.acceptance is None and f.accepted_length is None
    row = layers.row("none", layers.BASELINE, f, f.median_ms)
    assert len(row) == len(layers.HEADERS) and row[-1] == "1.00x" and row[7] == "n/a"


def test_on_cpu_the_gpu_layers_are_skipped_with_their_reasons():
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 4096}  # fmt: skip
    cpu = resolve("cpu")
    overrides: dict = {}
    previous = None
    skipped = []
    for name, layer, switch in layers.LADDER:
        trial = {**overrides, **switch}
        plan = select_flags(cpu, config, {**trial, "agents": 1})
        if layer and layers.skip_reason(cpu, plan, previous, layer):
            skipped.append(name)
            continue
        overrides, previous = trial, plan
    assert skipped == ["+ CUDA graphs", "+ FP8", "+ MTP"]

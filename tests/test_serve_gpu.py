"""GPU descriptions: nvidia-smi output, presets, cpu."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.serve import gpu as gpus

# nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits on a 4 x H100 node
SMI_4_H100 = "\n".join(["NVIDIA H100 80GB HBM3, 9.0, 81559"] * 4) + "\n"


def test_parse_nvidia_smi():
    g = gpus.parse_nvidia_smi(SMI_4_H100)
    assert (g.name, g.compute_capability, g.memory_gib, g.count) == (
        "NVIDIA H100 80GB HBM3",
        (9, 0),
        79.6,
        4,
    )
    assert g.source == "nvidia-smi" and g.cc == 9.0 and not g.is_cpu


def test_cuda_visible_devices_limits_the_count():
    assert gpus.parse_nvidia_smi(SMI_4_H100, visible="2,3").count == 2
    assert gpus.parse_nvidia_smi(SMI_4_H100, visible="").count == 4
    assert gpus.parse_nvidia_smi("") is None


def test_presets_and_resolve():
    assert gpus.preset("h100-80gb").cc == 9.0  # case-insensitive
    assert gpus.preset("A100-40GB").compute_capability == (8, 0)
    assert gpus.resolve("H200-141GB", 8).count == 8
    with pytest.raises(ValueError, match=r"unknown GPU preset 'B300'.*H100-80GB"):
        gpus.resolve("B300")
    with pytest.raises(ValueError, match="--gpus 0"):
        gpus.resolve("H100-80GB", 0)


def test_cpu_memory_is_the_kv_cache_space(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    c = gpus.resolve("cpu")
    assert (
        c.is_cpu and c.memory_gib == 3 and c.cc == 0.0 and c.to_dict()["compute_capability"] is None
    )
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert gpus.cpu().memory_gib == gpus.CPU_KV_CACHE_GIB


def test_short_names_for_the_common_gpus():
    assert gpus.preset("H200").name == "H200-141GB" and gpus.resolve("h200", 4).count == 4
    assert gpus.preset("h100").name == "H100-80GB" and gpus.preset("A100").memory_gib == 80.0


def _no_allocation(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", *gpus.ALLOCATION_ENV):
        monkeypatch.delenv(name, raising=False)


def test_auto_without_nvidia_smi_is_cpu(monkeypatch):
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    _no_allocation(monkeypatch)
    assert gpus.resolve("auto").is_cpu
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "0")  # a Slurm job without GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.resolve("auto").is_cpu


@pytest.mark.parametrize(
    ("name", "value"),
    [("CUDA_VISIBLE_DEVICES", "0"), ("SLURM_JOB_GPUS", "2,3"), ("SLURM_GPUS_ON_NODE", "4")],
)
def test_auto_refuses_cpu_when_gpus_were_allocated_but_unseen(monkeypatch, name, value):
    """A container started without --nv: the job has GPUs, the server would not."""
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    _no_allocation(monkeypatch)
    monkeypatch.setenv(name, value)
    with pytest.raises(gpus.NoGPUError, match=rf"{name}={value} says GPUs were allocated.*--nv"):
        gpus.resolve("auto")
    assert gpus.resolve("cpu").is_cpu  # asked for on purpose


def test_serve_explain_reports_the_missing_gpu(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "SLURM_JOB_GPUS": "0"}
    cmd = [sys.executable, "-m", "agent", "serve", "--explain", "--model-config"]
    config = Path(__file__).parent / "data" / "model_configs" / "qwen3-8b.json"
    done = subprocess.run([*cmd, str(config)], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "no nvidia-smi on PATH" in done.stderr

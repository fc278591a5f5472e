"""GPU descriptions: nvidia-smi output, presets, cpu."""

from __future__ import annotations

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


def test_auto_without_nvidia_smi_is_cpu(monkeypatch):
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    assert gpus.resolve("auto").is_cpu

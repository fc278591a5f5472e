"""What the server runs on: GPU model, compute capability, memory and count, or "cpu".

Detected with ``nvidia-smi`` where there is one; otherwise taken from a named preset, so that flag
selection for an H100 can be explained and tested on a machine without GPUs. ``auto`` plans for the
CPU only where nothing says GPUs were allocated: a Slurm GPU job or CUDA_VISIBLE_DEVICES without a
working ``nvidia-smi`` (a container started without ``--nv``) is an error, not a CPU server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, replace
from typing import Any

# Memory as nvidia-smi reports it (MiB / 1024), not the marketing number.
PRESETS: dict[str, tuple[tuple[int, int], float]] = {
    "A100-40GB": ((8, 0), 40.0),
    "A100-80GB": ((8, 0), 80.0),
    "H100-80GB": ((9, 0), 79.6),
    "H100-94GB": ((9, 0), 93.6),
    "H200-141GB": ((9, 0), 139.8),
    "L40S": ((8, 9), 45.0),
    "L4": ((8, 9), 22.5),
    "A10": ((8, 6), 22.5),
    "V100-32GB": ((7, 0), 32.0),
}
# Short names, case-insensitive: the memory size most clusters have.
ALIASES = {"A100": "A100-80GB", "H100": "H100-80GB", "H200": "H200-141GB"}
# Environment variables that say GPUs were allocated to this job (Slurm) or process (CUDA).
ALLOCATION_ENV = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS", "SLURM_GPUS_ON_NODE")
_COUNTS = ("SLURM_GPUS", "SLURM_GPUS_ON_NODE")  # counts, not device indices
CPU_KV_CACHE_GIB = 4.0  # VLLM_CPU_KVCACHE_SPACE when the environment does not set it


@dataclass(frozen=True)
class GPU:
    """One kind of device times ``count``; ``name == "cpu"`` means vLLM's CPU backend."""

    name: str
    compute_capability: tuple[int, int] | None
    memory_gib: float  # per device; on "cpu" the KV cache space vLLM may use
    count: int = 1
    source: str = "preset"  # "nvidia-smi", "preset" or "cpu"

    @property
    def is_cpu(self) -> bool:
        return self.compute_capability is None

    @property
    def cc(self) -> float:
        """Compute capability as a number (9.0 for an H100), 0.0 on cpu."""
        if self.compute_capability is None:
            return 0.0
        major, minor = self.compute_capability
        return major + minor / 10

    def label(self) -> str:
        if self.is_cpu:
            return f"cpu ({self.memory_gib:g} GiB KV cache space)"
        return f"{self.count} x {self.name} (cc {self.cc:.1f}, {self.memory_gib:.1f} GiB)"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = None if self.is_cpu else f"{self.cc:.1f}"
        return d


def cpu(kv_cache_gib: float | None = None) -> GPU:
    """The CPU backend; its "memory" is the KV cache space (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    if kv_cache_gib is None:
        env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        try:
            kv_cache_gib = int(env) if env not in ("", "0") else CPU_KV_CACHE_GIB
        except ValueError:
            raise ValueError(
                f"VLLM_CPU_KVCACHE_SPACE={env!r}: expected a whole number of GiB"
            ) from None
    return GPU("cpu", None, float(int(kv_cache_gib)), 1, "cpu")  # vLLM reads whole GiB


class NoGPUError(ValueError):
    """GPUs were allocated, but none can be seen."""


def preset(name: str, count: int = 1) -> GPU:
    """A named GPU description (case-insensitive): H100-80GB, A100-80GB, H200-141GB, L40S, or a
    short name (H100, A100, H200)."""
    lookup = {k.lower(): k for k in PRESETS} | {k.lower(): v for k, v in ALIASES.items()}
    key = lookup.get(name.lower())
    if key is None:
        raise ValueError(
            f"unknown GPU preset {name!r}; expected 'auto', 'cpu' or one of"
            f" {sorted(PRESETS) + sorted(ALIASES)}"
        )
    cc, mem = PRESETS[key]
    return GPU(key, cc, mem, count, "preset")


def parse_nvidia_smi(text: str, visible: str | None = None) -> GPU | None:
    """Parse ``nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits``.

    ``visible`` is CUDA_VISIBLE_DEVICES: where set, only that many devices count.
    """
    rows = [
        [c.strip() for c in line.split(",")] for line in text.strip().splitlines() if line.strip()
    ]
    rows = [r for r in rows if len(r) == 3]
    if not rows:
        return None
    name, cc_text, mem_mib = rows[0]
    major, _, minor = cc_text.partition(".")
    count = len(rows)
    if visible is not None and visible.strip():
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return GPU(
        name, (int(major), int(minor or 0)), round(float(mem_mib) / 1024, 1), count, "nvidia-smi"
    )


def detect() -> GPU | None:
    """The node's GPUs via nvidia-smi, or None where there is none (or it fails)."""
    return _query_nvidia_smi()[0]


def _query_nvidia_smi() -> tuple[GPU | None, str]:
    """(GPUs, why none) from nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "no nvidia-smi on PATH"
    query = [exe, "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{exe} failed ({exc})"
    gpu = parse_nvidia_smi(out, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return gpu, "" if gpu else f"{exe} lists no GPU"


def allocated_gpus(env: dict[str, str] | None = None) -> str | None:
    """The variable (and value) saying GPUs were allocated here, or None."""
    env = dict(os.environ) if env is None else env
    for name in ("CUDA_VISIBLE_DEVICES", *ALLOCATION_ENV):
        value = env.get(name, "").strip()
        # "" or "-1" hides every GPU, "NoDevFiles" / "(null)" mean none; a count of "0" is none,
        # but an index "0" (CUDA_VISIBLE_DEVICES, SLURM_JOB_GPUS) is the first GPU
        none = ("", "-1", "NoDevFiles", "(null)") + (("0",) if name in _COUNTS else ())
        if value not in none:
            return f"{name}={value}"
    return None


def auto() -> GPU:
    """nvidia-smi's GPUs; the CPU backend only where no GPU was allocated."""
    gpu, why = _query_nvidia_smi()
    if gpu is not None:
        return gpu
    allocated = allocated_gpus()
    if allocated:
        raise NoGPUError(
            f"--gpu auto: {allocated} says GPUs were allocated, but {why}: in a container, start it"
            " with GPU access (apptainer --nv, docker --gpus all); to serve on the CPU on purpose,"
            " give --gpu cpu"
        )
    return cpu()


def resolve(spec: str = "auto", count: int | None = None) -> GPU:
    """``auto`` (nvidia-smi; cpu where no GPU was allocated), ``cpu``, or a preset name; ``count``
    overrides the device count."""
    if spec == "auto":
        gpu = auto()
    elif spec.lower() == "cpu":
        gpu = cpu()
    else:
        gpu = preset(spec)
    if count is not None and not gpu.is_cpu:
        if count < 1:
            raise ValueError(f"--gpus {count}: expected at least 1")
        gpu = replace(gpu, count=count)
    return gpu

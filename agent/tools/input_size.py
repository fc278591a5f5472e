"""Whether an input fits in memory, judged from its header before anything big is read.

A matrix too big for the job is otherwise killed by the kernel (exit 137) with no record of why;
its header (a MatrixMarket size line, HDF5 shapes and lengths) says how big it is in milliseconds.
Too little memory is a fault of the job, not a verdict on the sample: the refusal is raised as
a MemoryError's context, which the registry turns into an InfrastructureError (exit 1, retried
with more memory, never kept as the sample's result).
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

import h5py
from scipy import io as spio

from agent.registry import ToolError

# Peak memory of load_data (reading, the counts check, the float32 CSR copy) per byte of the matrix
# as read (values, at least 4 bytes each, plus indices), measured once as the rise of peak RSS
# (VmHWM) over load_data on 4,000 x 20,000 matrices with 6.4 and 12.8 million nonzeros (scanpy
# 1.11, anndata 0.12, scipy 1.17): mtx 5.1 (parsed as int64, then float32, CSR, transposed,
# converted again), 10x .h5 2.1, sparse .h5ad 1.8; a dense .h5ad 2.5 (8% nonzero) to 4.5 (50%)
# times its size. Rounded up for headroom; dense counts are mostly zeros.
SPARSE_FACTOR = {"10x_mtx": 6.0, "10x_h5": 3.0, "h5ad": 3.0}
DENSE_FACTOR = 5.0

CGROUP_ROOT = Path("/sys/fs/cgroup")
# (file, cells, genes, what the matrix holds in words, bytes needed to read it)
Declared = tuple[Path, int, int, str, float]


def check_fits(path: Path, fmt: str) -> None:
    """Refuse an input (a 10x matrix.mtx(.gz), .h5 or .h5ad) that declares more than fits."""
    declared = {"10x_mtx": _mtx, "10x_h5": _h5, "h5ad": _h5ad}[fmt](path)
    if declared is None:  # not the layout expected: the reader says what is wrong
        return
    file, n_cells, n_genes, holds, need = declared
    room, limit = available_memory()
    if need > room:
        short = (
            f"{file} declares {n_cells:,} cells x {n_genes:,} genes with {holds}: reading it "
            f"needs about {_size(need)}, this job has {_size(room)} available ({limit}); "
            "give the job more memory"
        )
        raise ToolError(short) from MemoryError(short)


def _csr_bytes(rows: int, cols: int, nnz: int, value_bytes: int, index_bytes: int) -> int:
    return nnz * (max(value_bytes, 4) + index_bytes) + (rows + cols) * index_bytes


def _mtx(file: Path) -> Declared:
    genes, cells, entries, *_ = spio.mminfo(str(file))  # the header only; genes x cells
    index = 4 if max(genes, cells, entries) < 2**31 else 8  # what scipy picks
    need = SPARSE_FACTOR["10x_mtx"] * _csr_bytes(cells, genes, entries, 8, index)
    return file, cells, genes, f"{entries:,} nonzero values", need


def _h5(file: Path) -> Declared | None:
    with h5py.File(file, "r") as f:
        groups = [f["matrix"]] if "matrix" in f else list(f.values())  # v3, or v2: per genome
        m = next((g for g in groups if isinstance(g, h5py.Group) and "shape" in g), None)
        if m is None or "data" not in m or "indices" not in m:
            return None
        genes, cells = (int(n) for n in m["shape"][()])
        return file, cells, genes, *_sparse(m, cells, genes, "10x_h5")


def _h5ad(file: Path) -> Declared | None:
    """X, its layers and raw: anndata reads them all, whichever one holds the counts."""
    with h5py.File(file, "r") as f:
        nodes = [f[k] for k in ("X", "raw/X") if k in f] + list(f.get("layers", {}).values())
        parts = [(node.name.lstrip("/"), part) for node in nodes if (part := _h5ad_part(node))]
    if not parts:
        return None
    cells, genes, holds, _ = parts[0][1]
    if len(parts) > 1:
        holds = ", ".join(f"{p[2]} in {name}" for name, p in parts)
    return file, cells, genes, holds, sum(p[3] for _, p in parts)


def _h5ad_part(node: h5py.Group | h5py.Dataset) -> tuple[int, int, str, float] | None:
    """A matrix's shape, what it holds in words and the bytes needed, from its metadata."""
    if isinstance(node, h5py.Dataset):
        if node.ndim != 2:
            return None
        rows, cols = node.shape
        need = DENSE_FACTOR * rows * cols * max(node.dtype.itemsize, 4)
        return rows, cols, f"{rows * cols:,} values (dense)", need
    shape = node.attrs.get("shape", node.attrs.get("h5sparse_shape"))  # anndata >= 0.7, older
    if shape is None or "data" not in node or "indices" not in node:
        return None
    rows, cols = (int(n) for n in shape)
    return rows, cols, *_sparse(node, rows, cols, "h5ad")


def _sparse(group: h5py.Group, rows: int, cols: int, fmt: str) -> tuple[str, float]:
    """What a sparse matrix's group holds and the bytes needed, from the lengths of its arrays."""
    data, indices = group["data"], group["indices"]
    nnz = len(data)
    need = _csr_bytes(rows, cols, nnz, data.dtype.itemsize, indices.dtype.itemsize)
    return f"{nnz:,} nonzero values", SPARSE_FACTOR[fmt] * need


def available_memory(cgroup_root: Path = CGROUP_ROOT) -> tuple[int, str]:
    """The most this process can still allocate, and the limit that sets it: free memory, the
    memory limit of its cgroup (v2, or v1's memory controller: a Slurm job's or a container's)
    less the usage, Slurm's own figure for the job (--mem, --mem-per-cpu), ulimit -v."""
    found = []
    if (free := _kib_field("/proc/meminfo", "MemAvailable")) is not None:
        found.append((free, "free memory, MemAvailable in /proc/meminfo"))
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    found += cgroup_room(lines, cgroup_root)
    found += _slurm_room()
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = _kib_field("/proc/self/status", "VmSize") or 0
        found.append((soft - used, "the address-space limit, ulimit -v"))
    return min(found, default=(2**63, "no limit known"))


def cgroup_room(lines: list[str], root: Path = CGROUP_ROOT) -> list[tuple[int, str]]:
    """Limit less usage of the cgroup that ``lines`` (/proc/self/cgroup) name and of each above
    it, v2 (``0::/path``) and v1 (``N:memory:/path``, or memory among other controllers): Slurm
    sets the job's limit a level or two above the task's. Page cache the kernel can drop does not
    count. On v1 /proc/meminfo is the host's, so this is the only figure that binds."""
    found = []
    for line in lines:
        if line.count(":") < 2:  # not a cgroup line: nothing to learn from it
            continue
        _, controllers, own = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            start, files = root / own.lstrip("/"), _V2
            top = root
        elif "memory" in controllers.split(","):
            top = root / "memory"
            start, files = top / own.lstrip("/"), _V1
        else:
            continue
        for folder in (start, *start.parents):
            if not folder.is_relative_to(top):
                break
            if (room := _room(folder, *files)) is not None:
                found.append((room, f"the memory limit of cgroup {folder}"))
    return found


# (limit, usage, reclaimable page cache in memory.stat) of cgroup v2 and v1
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
# v1 writes "no limit" as the largest page-aligned signed 64-bit number
_V1_UNLIMITED = 2**62


def _room(folder: Path, limit_file: str, usage_file: str, reclaimable: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        used = int((folder / usage_file).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= _V1_UNLIMITED:
        return None
    return int(limit) - used + int(stat.get(reclaimable, 0))


def _slurm_room() -> list[tuple[int, str]]:
    """Slurm's memory for the job (MB) less this process's resident memory: the limit Slurm
    enforces where no cgroup shows it (e.g. a proctrack without memory cgroups)."""
    if mb := _positive("SLURM_MEM_PER_NODE"):
        limit, name = mb, f"SLURM_MEM_PER_NODE={mb}"
    elif (per := _positive("SLURM_MEM_PER_CPU")) and (cpus := _positive("SLURM_CPUS_ON_NODE")):
        limit, name = per * cpus, f"SLURM_MEM_PER_CPU={per} x {cpus} CPUs"
    else:
        return []
    used = _kib_field("/proc/self/status", "VmRSS") or 0
    return [(limit * 2**20 - used, f"Slurm's memory for the job, {name} MB")]


def _kib_field(file: str, key: str) -> int | None:
    """A 'Key:  N kB' line of a /proc file, in bytes."""
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", Path(file).read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match[1]) * 1024 if match else None


def _size(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.0f} MiB"


def _positive(name: str) -> int | None:
    """A Slurm figure as a positive integer; None where unset, malformed or 0 (``--mem=0``: all
    of the node's memory, which the cgroup then shows)."""
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None

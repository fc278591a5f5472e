"""A large cohort made cheaply: copies of one finished sample folder under new names.

For the report's scale benchmark (bench/report_scale.py) and its 1,000-sample browser test:
running 1,000 analyses would take hours, and the report only reads the folders. Each copy gets
its own world state (new sample name, a few numbers changed so that sorting, drift flags and
figures have something to show), the metrics and replay; the large files (final AnnData, plots)
are hard links, so 1,000 copies cost little disk. Every ``failed_every``-th copy is marked
failed and every ``unreplayed_every``-th has no replay.json, as in a real cohort.

``finished_copy`` makes one sound finished sample of a given final object instead (its record
passes the integrity check), for the cohort steps that read only such samples.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import orjson

from agent.record.layout import SampleLayout
from agent.tool_declarations import FINISH


def _link(src: Path, dst: Path) -> None:
    """Hard link (no copy of the bytes); a copy where the filesystem refuses links."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_cohort(
    source: Path,
    root: Path,
    n: int,
    prefix: str = "s",
    seed: int = 0,
    failed_every: int = 50,
    unreplayed_every: int = 10,
) -> list[Path]:
    """``n`` copies of the finished sample folder ``source`` under ``root``; their world states."""
    src = SampleLayout(source)
    doc = orjson.loads(src.record.read_bytes())
    metrics = src.metrics.read_bytes() if src.metrics.is_file() else None
    replay = orjson.loads(src.replay.read_bytes()) if src.replay.is_file() else None
    plots = sorted(src.plots.glob("*.png")) if src.plots.is_dir() else []
    rng = random.Random(seed)
    width = len(str(n - 1))
    out = []
    for i in range(n):
        name = f"{prefix}{i:0{width}d}"
        dst = SampleLayout(root / name)
        dst.plots.mkdir(parents=True, exist_ok=True)
        copy = orjson.loads(orjson.dumps(doc))  # deep copy, cheaper than copy.deepcopy
        copy["meta"]["sample"] = name
        failed = failed_every and i % failed_every == failed_every - 1
        for e in copy["entries"]:
            # a few choices and outcomes vary a little; one in ~40 drifts far (a flag to show)
            if e["tool"] == "filter_by_qc" and e["status"] == "ok":
                far = rng.random() < 0.025
                e["params"]["max_pct_mt"] = round(
                    e["params"]["max_pct_mt"] * (3.0 if far else rng.uniform(0.9, 1.1)), 2
                )
            if e["tool"] == "leiden" and e["status"] == "ok":
                e["result"]["n_clusters"] = max(2, e["result"]["n_clusters"] + rng.randint(-1, 1))
            if e["tool"] == FINISH and e["status"] == "ok":
                e["result"]["n_cells"] = int(e["result"]["n_cells"] * rng.uniform(0.92, 1.0))
        if failed:
            copy["entries"] = [e for e in copy["entries"] if e["tool"] != FINISH]
            copy["meta"]["status"] = "step_limit"
            copy["meta"]["error"] = "step limit reached without finish (copy marked failed)"
        dst.record.write_bytes(orjson.dumps(copy))
        if metrics is not None:
            dst.metrics.write_bytes(metrics)
        if replay is not None and not (unreplayed_every and i % unreplayed_every == 0):
            dst.replay.write_bytes(orjson.dumps({**replay, "world_state": str(dst.record)}))
        if src.final.is_file() and not failed:
            _link(src.final, dst.final)
        for p in plots:
            _link(p, dst.plots / p.name)
        out.append(dst.record)
    return out


def finished_copy(
    source: Path, root: Path, name: str, adata: Any, digest: dict[str, Any] | None = None
) -> Path:
    """A finished sample folder ``root/name`` whose final object is ``adata`` (an AnnData, or
    the path of a final object to hard-link, with its ``digest`` when known): the record of the
    finished sample folder ``source`` under the new name, its finish step's data digest that of
    the object, every chain and the seal computed anew (unkeyed hashes, as any program can), so
    that ``check_record`` passes. Returns its world state."""
    import anndata as ad

    from agent.digest import digest_adata
    from agent.record.world_state import Entry, link, seal

    dst = SampleLayout(root / name)
    dst.root.mkdir(parents=True)
    if isinstance(adata, Path):
        _link(adata, dst.final)
    else:
        adata.write_h5ad(dst.final)
    doc = orjson.loads(SampleLayout(source).record.read_bytes())
    doc["meta"]["sample"] = name
    finish = next(e for e in reversed(doc["entries"]) if e["tool"] == FINISH)
    finish["digest_after"] = digest or digest_adata(ad.read_h5ad(dst.final))
    chain = ""
    for e in doc["entries"]:
        e.pop("chain")
        e["chain"] = chain = link(chain, Entry.from_json(e).to_json())
    doc["meta"]["seal"] = seal(doc["meta"], chain)
    dst.record.write_bytes(orjson.dumps(doc))
    return dst.record

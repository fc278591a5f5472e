"""Seeded synthetic raw-count samples with planted truth, and the demo cohort.

Counts are negative binomial (gamma-Poisson) draws around per-cell-type expression profiles built
from gene programmes of blood cell types (real human genes, written independently of the marker
sets that annotation checks), with realistic library sizes, a share of damaged
cells (high mitochondrial, little nuclear RNA), empty barcodes (ambient RNA only) and heterotypic
doublets. The truth per barcode (type, doublet, damaged, empty) is written to ``truth.tsv`` beside
the data, never into the matrix file, so an analysis cannot see it.

Background genes are the 765 gene symbols of scanpy's bundled ``pbmc68k_reduced`` data set, frozen
in ``background_genes.tsv`` so the data do not change with scanpy releases. Real matrices also hold
thousands of barely expressed features; ``N_TAIL`` such genes, named ``SYNTH-0001``... so that no one
takes them for real genes, give realistic sparsity and genes per cell.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import anndata as ad
import h5py
import numpy as np
import pandas as pd
from scipy import io as spio
from scipy import sparse

from agent import say

Format = Literal["mtx", "h5ad", "h5"]
FORMATS: tuple[Format, ...] = ("mtx", "h5ad", "h5")
TRUTH_FILE = "truth.tsv"
PARAMS_FILE = "synthetic.json"
INPUT_NAMES: dict[str, str] = {"mtx": ".", "h5ad": "counts.h5ad", "h5": "counts.h5"}

MT_GENES = [
    "MT-ND1",
    "MT-ND2",
    "MT-CO1",
    "MT-CO2",
    "MT-ATP8",
    "MT-ATP6",
    "MT-CO3",
    "MT-ND3",
    "MT-ND4L",
    "MT-ND4",
    "MT-ND5",
    "MT-ND6",
    "MT-CYB",
]
RIBO_GENES = [
    "RPL3",
    "RPL4",
    "RPL5",
    "RPL6",
    "RPL7",
    "RPL7A",
    "RPL8",
    "RPL9",
    "RPL10",
    "RPL10A",
    "RPL11",
    "RPL12",
    "RPL13",
    "RPL13A",
    "RPL14",
    "RPL15",
    "RPL17",
    "RPL18",
    "RPL18A",
    "RPL19",
    "RPL21",
    "RPL22",
    "RPL23",
    "RPL23A",
    "RPL24",
    "RPL26",
    "RPL27",
    "RPL27A",
    "RPL28",
    "RPL29",
    "RPL30",
    "RPL31",
    "RPL32",
    "RPL34",
    "RPL35",
    "RPL35A",
    "RPL36",
    "RPL36A",
    "RPL37",
    "RPL37A",
    "RPL38",
    "RPL39",
    "RPL41",
    "RPLP0",
    "RPLP1",
    "RPLP2",
    "RPS2",
    "RPS3",
    "RPS3A",
    "RPS4X",
    "RPS5",
    "RPS6",
    "RPS7",
    "RPS8",
    "RPS9",
    "RPS10",
    "RPS11",
    "RPS12",
    "RPS13",
    "RPS14",
    "RPS15",
    "RPS15A",
    "RPS16",
    "RPS17",
    "RPS18",
    "RPS19",
    "RPS20",
    "RPS21",
    "RPS23",
    "RPS24",
    "RPS25",
    "RPS26",
    "RPS27",
    "RPS27A",
    "RPS28",
    "RPS29",
    "RPSA",
]
HB_GENES = ["HBA1", "HBA2", "HBB", "HBD", "HBG1", "HBG2", "HBM", "HBQ1", "HBZ", "HBE1"]
N_TAIL = 3000

# Gene programmes: gene -> expected UMIs per 10,000 in a cell that runs the programme. They are
# written from what each blood cell type expresses, independently of agent/data/markers.json:
# each type runs only part of its marker set (the annotation must work from what is there),
# genes on no marker list (LDHB, GZMA, VPREB3, GP1BB...) and genes that two types share (NKG7,
# FCGR3A, TYROBP, HLA class II, CSF3R, C1QA, PLD4). tests/test_synthetic.py keeps it so.
PROGRAMS: dict[str, dict[str, float]] = {
    "T": {"CD3D": 30, "CD3E": 20, "CD3G": 8, "CD2": 10, "IL32": 25, "TRAC": 15, "LCK": 6, "BCL11B": 5},
    "naive": {"CCR7": 10, "LEF1": 8, "TCF7": 8, "SELL": 6, "LDHB": 30, "CD27": 6, "TRABD2A": 3},
    "CD4": {"CD4": 4, "TSHZ2": 3, "ADTRP": 3},
    "cytotoxic": {"NKG7": 30, "CCL5": 30, "GZMA": 12, "CST7": 10, "CTSW": 10},
    "CD8 memory": {
        "CD8A": 12, "CD8B": 10, "GZMK": 10, "CD160": 3, "DUSP2": 6, "EOMES": 3, "CXCR3": 3,
    },
    "NK": {
        "GNLY": 60, "GZMB": 15, "PRF1": 12, "KLRD1": 12, "FGFBP2": 10, "SH2D1B": 4, "KIR2DL1": 3,
        "FCGR3A": 10, "TYROBP": 20, "FCER1G": 10,
    },
    "B": {
        "MS4A1": 15, "CD79A": 30, "CD79B": 15, "BANK1": 6, "IGHM": 30, "VPREB3": 6, "FCER2": 5,
        "BLK": 5, "PAX5": 4,
    },
    "MHC-II": {
        "HLA-DRA": 60, "HLA-DRB1": 30, "HLA-DPA1": 20, "HLA-DPB1": 30, "CD74": 100, "HLA-DQA1": 8,
        "HLA-DQB1": 8,
    },
    "myeloid": {
        "TYROBP": 40, "FCER1G": 30, "CST3": 60, "AIF1": 30, "LST1": 20, "FTL": 150, "FTH1": 100,
        "PSAP": 20,
    },
    "CD14 Mono": {
        "CD14": 15, "LYZ": 300, "S100A8": 200, "S100A9": 250, "MNDA": 15, "CSF3R": 8, "CD36": 8,
        "CTSS": 20, "G0S2": 6,
    },
    "FCGR3A Mono": {
        "FCGR3A": 25, "MS4A7": 15, "RHOC": 10, "HES4": 6, "CX3CR1": 6, "SIGLEC10": 4, "C1QA": 4,
    },
    "DC": {"FCER1A": 20, "CLEC10A": 10, "CD1C": 10, "PLD4": 4, "PKIB": 5, "CD1E": 5},
    "Platelet": {
        "PPBP": 200, "PF4": 120, "GNG11": 20, "TUBB1": 10, "SPARC": 15, "CLU": 10, "GP1BB": 10,
        "TREML1": 6, "RGS18": 8,
    },
}  # fmt: skip

# Lineages: doublets join cells of two lineages (two T-cell types in one droplet look like one
# cell to any detector, so they would only blur what detection can be expected to find).
LINEAGE = {
    "CD4 naive T": "T/NK", "CD8 effector-memory T": "T/NK", "NK": "T/NK", "B": "B",
    "CD14 Mono": "myeloid", "FCGR3A Mono": "myeloid", "DC": "myeloid", "Platelet": "platelet",
}  # fmt: skip

# Cell type -> (program, weight); relative cell size (library size); ribosomal share factor.
CELL_TYPES: dict[str, tuple[dict[str, float], float, float]] = {
    "CD4 naive T": ({"T": 1, "naive": 1, "CD4": 1}, 1.0, 1.3),
    "CD8 effector-memory T": ({"T": 1, "CD8 memory": 1, "cytotoxic": 0.6}, 1.0, 1.2),
    "NK": ({"NK": 1, "cytotoxic": 1}, 1.1, 1.0),
    "B": ({"B": 1, "MHC-II": 1}, 1.0, 1.1),
    "CD14 Mono": ({"myeloid": 1, "CD14 Mono": 1, "MHC-II": 0.4}, 1.5, 0.7),
    "FCGR3A Mono": ({"myeloid": 1, "FCGR3A Mono": 1, "MHC-II": 0.5}, 1.4, 0.7),
    "DC": ({"myeloid": 0.7, "DC": 1, "MHC-II": 2}, 1.4, 0.8),
    "Platelet": ({"Platelet": 1}, 0.35, 0.5),
}

# A condition's planted truth (SampleSpec.condition_effect, off by default): an interferon
# response, genes of the background set written apart from any marker list (IRF7, a pDC marker,
# left out), raised CONDITION_FOLD-fold in CONDITION_TYPES only, so a test per cell type must find
# them there and not elsewhere; and CONDITION_SHIFT, a factor on some types' shares (the others'
# shares then shrink by the renormalisation alone).
CONDITION_GENES = ("OAS1", "LY6E", "IFITM3", "IFITM1", "ISG20", "BST2", "SP110")
CONDITION_FOLD = 3.0
CONDITION_TYPES = ("CD14 Mono", "CD4 naive T")
CONDITION_SHIFT = {"B": 2.5}
# Replicates of one biology (SampleSpec.profile_seed): each sample scales every gene by a draw of
# this log-normal spread, as donors differ (a pseudobulk test then has real dispersion to estimate)
REPLICATE_SD = 0.15

PBMC_COMPOSITION = {
    "CD4 naive T": 0.34, "CD8 effector-memory T": 0.14, "NK": 0.09, "B": 0.13, "CD14 Mono": 0.19, "FCGR3A Mono": 0.06,
    "DC": 0.03, "Platelet": 0.02,
}  # fmt: skip


@dataclass(frozen=True)
class SampleSpec:
    """What to simulate: sizes, rates and composition; everything else follows from the seed."""

    name: str
    n_cells: int  # barcodes holding cells (singlets and doublets); empty barcodes come on top
    seed: int
    composition: dict[str, float] = field(default_factory=lambda: dict(PBMC_COMPOSITION))
    damaged_fraction: float = 0.08  # of singlets
    doublet_fraction: float = 0.05  # of cell barcodes
    empty_fraction: float = 0.08  # empty barcodes per cell barcode
    median_umis: float = 4000.0
    # mean share of each cell barcode's UMIs that is ambient RNA (the empty droplets' profile);
    # each cell's own share drawn from a Beta of this mean (truth.tsv: ambient_fraction)
    ambient_fraction: float = 0.0
    format: Format = "mtx"
    description: str = ""
    # A cohort's replicates: the cell types' profiles drawn from this seed, shared with the samples
    # that name it (None: from the sample's own seed, as every sample had before), then varied by
    # REPLICATE_SD; and the condition's planted truth (CONDITION_GENES, CONDITION_SHIFT)
    profile_seed: int | None = None
    condition_effect: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.n_cells < 50:
            problems.append(f"n_cells={self.n_cells} (expected at least 50)")
        for name in ("damaged_fraction", "doublet_fraction", "empty_fraction", "ambient_fraction"):
            value = getattr(self, name)
            if not 0 <= value <= 0.5:
                problems.append(f"{name}={value} (expected between 0 and 0.5)")
        if not self.median_umis >= 100:
            problems.append(f"median_umis={self.median_umis} (expected at least 100)")
        if self.format not in FORMATS:
            problems.append(f"format={self.format!r} (expected one of {', '.join(FORMATS)})")
        unknown = set(self.composition) - set(CELL_TYPES)
        if unknown:
            problems.append(
                f"unknown cell types {sorted(unknown)} (known: {', '.join(CELL_TYPES)})"
            )
        if not self.composition or any(v < 0 for v in self.composition.values()):
            problems.append("composition needs non-negative shares for at least one cell type")
        elif (
            len({LINEAGE[t] for t, v in self.composition.items() if v > 0 and t in LINEAGE}) < 2
            and self.doublet_fraction > 0
        ):
            problems.append(
                "heterotypic doublets need cell types of at least two lineages in the composition"
            )
        if problems:
            raise ValueError(f"synthetic sample {self.name!r}: " + "; ".join(problems))


DEMO_COHORT: dict[str, SampleSpec] = {
    spec.name: spec
    for spec in (
        SampleSpec(
            "pbmc1", 3000, seed=101, format="mtx",
            description="typical PBMC, 8% damaged cells, 10x mtx folder",
        ),
        SampleSpec(
            "pbmc2", 1500, seed=202, format="h5ad", damaged_fraction=0.2, doublet_fraction=0.04,
            median_umis=5000,
            composition={**PBMC_COMPOSITION, "CD14 Mono": 0.32, "CD4 naive T": 0.22, "FCGR3A Mono": 0.08},
            description="small, monocyte-rich, stressed (20% damaged cells), .h5ad",
        ),
        SampleSpec(
            "pbmc3", 4000, seed=303, format="h5", damaged_fraction=0.04, doublet_fraction=0.07,
            median_umis=3000,
            composition={
                **PBMC_COMPOSITION, "CD4 naive T": 0.42, "CD8 effector-memory T": 0.18,
                "CD14 Mono": 0.1,
            },
            description="larger, T-cell-rich, shallower, more doublets, 10x .h5",
        ),
        # a condition: pbmc1's biology in replicates, two of them treated (config/samples.tsv).
        # Their ambient loads differ but average the same in each condition (control 0 and 0.15,
        # treated 0.05 and 0.1), so the load is no proxy for the condition in the tests of it.
        SampleSpec(
            "pbmc4", 1600, seed=404, format="h5ad", damaged_fraction=0.06, profile_seed=101,
            ambient_fraction=0.15,
            composition={**PBMC_COMPOSITION, "CD14 Mono": 0.22, "CD4 naive T": 0.31},
            description="pbmc1's biology, another donor (control), 15% ambient RNA, .h5ad",
        ),
        SampleSpec(
            "pbmc5", 1700, seed=505, format="mtx", damaged_fraction=0.1, profile_seed=101,
            condition_effect=True, ambient_fraction=0.05,
            composition={**PBMC_COMPOSITION, "CD4 naive T": 0.37, "CD8 effector-memory T": 0.11},
            description="pbmc1's biology, treated: interferon response in CD14 monocytes and "
            "CD4 naive T cells, 2.5-fold B-cell share, 5% ambient RNA, 10x mtx folder",
        ),
        SampleSpec(
            "pbmc6", 1800, seed=606, format="h5", damaged_fraction=0.05, profile_seed=101,
            condition_effect=True, ambient_fraction=0.1,
            composition={**PBMC_COMPOSITION, "CD14 Mono": 0.17, "NK": 0.11},
            description="pbmc1's biology, treated, another donor, 10% ambient RNA, 10x .h5",
        ),
    )
}  # fmt: skip


def background_genes() -> list[str]:
    """Background gene symbols, without those the generator uses in a named role."""
    text = resources.files("agent.data").joinpath("background_genes.tsv").read_text()
    named = set(MT_GENES) | set(RIBO_GENES) | set(HB_GENES)
    named |= {g for program in PROGRAMS.values() for g in program}
    prefixes = ("MT-", "RPL", "RPS", "HB")  # keep the QC gene sets exactly as planted
    return [g for g in text.split()[1:] if g not in named and not g.startswith(prefixes)]


def _gene_table() -> tuple[list[str], dict[str, np.ndarray]]:
    """All gene symbols and the index of each named group in that order."""
    program_genes = list(dict.fromkeys(g for p in PROGRAMS.values() for g in p))
    groups = {
        "program": program_genes, "mt": MT_GENES, "ribo": RIBO_GENES, "hb": HB_GENES,
        "background": background_genes(), "tail": [f"SYNTH-{i:04d}" for i in range(1, N_TAIL + 1)],
    }  # fmt: skip
    genes: list[str] = []
    index = {}
    for name, members in groups.items():
        index[name] = np.arange(len(genes), len(genes) + len(members))
        genes.extend(members)
    return genes, index


def _type_profiles(
    genes: list[str], index: dict[str, np.ndarray], rng: np.random.Generator
) -> np.ndarray:
    """Expected share of each gene per cell type (rows sum to 1), in CELL_TYPES order."""
    position = {g: i for i, g in enumerate(genes)}
    base = np.zeros(len(genes))
    base[index["program"]] = 0.1  # leaky expression outside the program
    base[index["mt"]] = rng.lognormal(np.log(35), 0.7, len(index["mt"]))
    base[index["hb"]] = 0.05  # ambient red-cell RNA
    ribo = rng.lognormal(np.log(40), 0.5, len(index["ribo"]))
    background = rng.lognormal(np.log(4), 1.2, len(index["background"]))
    base[index["tail"]] = rng.lognormal(np.log(0.2), 1.2, len(index["tail"]))
    profiles = []
    for programs, _, ribo_factor in CELL_TYPES.values():
        level = base.copy()
        level[index["ribo"]] = ribo * ribo_factor
        # each type shifts a few background genes too, as real types differ beyond markers
        shift = np.ones(len(background))
        chosen = rng.random(len(background)) < 0.06
        shift[chosen] = rng.lognormal(0.0, 0.8, chosen.sum())
        level[index["background"]] = background * shift
        for program, weight in programs.items():
            for gene, umis in PROGRAMS[program].items():
                level[position[gene]] += weight * umis
        profiles.append(level / level.sum())
    return np.asarray(profiles)


def _renormalised(profiles: np.ndarray) -> np.ndarray:
    return profiles / profiles.sum(axis=1, keepdims=True)


def condition_factors(genes: list[str]) -> np.ndarray:
    """Cell type x gene factors of the planted condition: CONDITION_FOLD on CONDITION_GENES in
    CONDITION_TYPES (rows in CELL_TYPES order), 1 elsewhere."""
    factors = np.ones((len(CELL_TYPES), len(genes)))
    columns = [genes.index(g) for g in CONDITION_GENES]
    for row, name in enumerate(CELL_TYPES):
        if name in CONDITION_TYPES:
            factors[row, columns] = CONDITION_FOLD
    return factors


def simulate(spec: SampleSpec) -> tuple[ad.AnnData, pd.DataFrame]:
    """Raw counts (cells x genes, CSR, integer-valued float32) and the per-barcode truth."""
    rng = np.random.default_rng(spec.seed)
    genes, index = _gene_table()
    type_names = list(CELL_TYPES)
    if spec.profile_seed is None:
        profiles = _type_profiles(genes, index, rng)
    else:
        profiles = _type_profiles(genes, index, np.random.default_rng(spec.profile_seed))
        profiles = _renormalised(profiles * rng.lognormal(0.0, REPLICATE_SD, len(genes)))
    sizes = np.array([CELL_TYPES[t][1] for t in type_names])
    shares = np.array([spec.composition.get(t, 0.0) for t in type_names])
    if spec.condition_effect:
        profiles = _renormalised(profiles * condition_factors(genes))
        shares = shares * np.array([CONDITION_SHIFT.get(t, 1.0) for t in type_names])
    shares = shares / shares.sum()

    n_doublets = round(spec.doublet_fraction * spec.n_cells)
    n_singlets = spec.n_cells - n_doublets
    n_empty = round(spec.empty_fraction * spec.n_cells)

    def library(types: np.ndarray) -> np.ndarray:
        return spec.median_umis * sizes[types] * rng.lognormal(0.0, 0.35, len(types))

    # singlets; a per-cell factor spreads the mitochondrial share as in healthy cells
    kinds = rng.choice(len(type_names), n_singlets, p=shares)
    share = profiles[kinds].copy()
    share[:, index["mt"]] *= rng.lognormal(0.0, 0.3, (n_singlets, 1))
    share /= share.sum(axis=1, keepdims=True)
    # damaged cells lose cytoplasmic RNA: a mitochondrial share of 15-60% and a smaller library
    damaged = np.zeros(n_singlets, bool)
    damaged[rng.choice(n_singlets, round(spec.damaged_fraction * n_singlets), replace=False)] = True
    target = rng.uniform(0.15, 0.6, damaged.sum())
    mt_now = share[damaged][:, index["mt"]].sum(axis=1)
    rescale = ((1 - target) / (1 - mt_now))[:, None] * np.ones((1, len(genes)))
    rescale[:, index["mt"]] = (target / mt_now)[:, None]
    share[damaged] *= rescale
    lib = library(kinds)
    lib[damaged] *= rng.uniform(0.25, 0.6, damaged.sum())
    mean = share * lib[:, None]
    labels = [type_names[k] for k in kinds]

    # heterotypic doublets: two cells of different lineages in one droplet
    lineage = np.array([LINEAGE[t] for t in type_names])
    first = rng.choice(len(type_names), n_doublets, p=shares)
    second = np.empty_like(first)
    for i, a in enumerate(first):
        others = np.where(lineage == lineage[a], 0.0, shares)
        second[i] = rng.choice(len(type_names), p=others / others.sum())
    doublet_mean = (
        profiles[first] * library(first)[:, None] + profiles[second] * library(second)[:, None]
    )
    labels += [
        "+".join(sorted((type_names[a], type_names[b]))) for a, b in zip(first, second, strict=True)
    ]

    # empty barcodes hold ambient RNA: the sample's average profile at a few dozen UMIs
    ambient = shares @ profiles
    empty_mean = np.outer(rng.lognormal(np.log(100), 0.5, n_empty), ambient)
    labels += ["empty"] * n_empty

    mean = np.vstack([mean, doublet_mean, empty_mean])
    planted = _ambient_load(spec, mean, ambient, n_singlets + n_doublets)
    theta = rng.lognormal(np.log(4), 0.5, len(genes))  # per-gene inverse overdispersion
    chunks = [  # row blocks keep the float64 draws small
        sparse.csr_matrix(rng.poisson(rng.gamma(theta, block / theta)).astype(np.float32))
        for block in np.array_split(mean, max(1, len(mean) // 1000))
    ]
    counts = sparse.vstack(chunks, format="csr")

    n = len(labels)
    truth = pd.DataFrame(
        {
            "barcode": _barcodes(n, rng),
            "cell_type": labels,
            "is_doublet": np.r_[
                np.zeros(n_singlets, bool), np.ones(n_doublets, bool), np.zeros(n_empty, bool)
            ],
            "is_damaged": np.r_[damaged, np.zeros(n_doublets + n_empty, bool)],
            "is_empty": np.r_[np.zeros(spec.n_cells, bool), np.ones(n_empty, bool)],
        }
    )
    if spec.ambient_fraction > 0:  # the column only where a load was planted: others as before
        truth["ambient_fraction"] = planted
    order = rng.permutation(n)  # barcodes in no particular order, as a real matrix
    truth = truth.iloc[order].reset_index(drop=True)
    adata = ad.AnnData(
        counts[order],
        obs=pd.DataFrame(index=pd.Index(truth["barcode"].to_numpy(), name="barcode")),
        var=pd.DataFrame(
            {
                "gene_ids": [f"SYN{i:05d}" for i in range(len(genes))],
                "feature_types": "Gene Expression",
            },
            index=pd.Index(genes, name="gene_symbols"),
        ),
    )
    return adata, truth


# Spread of the cells' ambient shares around their mean: Beta(a, b) with a + b = this.
AMBIENT_CONCENTRATION = 40.0


def _ambient_load(spec: SampleSpec, mean: np.ndarray, ambient: np.ndarray, n_cells: int) -> Any:
    """Mix the ambient profile into the first ``n_cells`` rows of expected counts (in place),
    each row's share drawn around ``spec.ambient_fraction`` and its total kept; the shares
    (1 for empty droplets, all ambient). Draws from a generator of its own, so that a sample
    without a load is drawn exactly as before."""
    shares = np.ones(len(mean))
    if spec.ambient_fraction <= 0:
        shares[:n_cells] = 0.0
        return shares
    rng = np.random.default_rng([spec.seed, 1])
    a = spec.ambient_fraction * AMBIENT_CONCENTRATION
    shares[:n_cells] = rng.beta(a, AMBIENT_CONCENTRATION - a, n_cells)
    totals = mean[:n_cells].sum(axis=1, keepdims=True)
    cells = shares[:n_cells, None]
    mean[:n_cells] = (1 - cells) * mean[:n_cells] + cells * totals * ambient[None, :]
    return shares


def _barcodes(n: int, rng: np.random.Generator) -> list[str]:
    """Unique 16-base 10x-style barcodes with the '-1' GEM-well suffix."""
    out: dict[str, None] = {}
    while len(out) < n:
        for row in rng.choice(list("ACGT"), (n, 16)):
            out["".join(row) + "-1"] = None
    return list(out)[:n]


def _gzip_bytes(path: Path, data: bytes) -> None:
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as gz,
    ):
        gz.write(data)  # mtime=0: the same sample gives byte-identical files; level 1: fast


def write_10x_mtx(adata: ad.AnnData, folder: Path) -> None:
    """Cell Ranger v3 layout: matrix.mtx.gz (genes x cells), barcodes.tsv.gz, features.tsv.gz."""
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    spio.mmwrite(buffer, sparse.csr_matrix(adata.X.T, dtype=np.int64), field="integer")
    _gzip_bytes(folder / "matrix.mtx.gz", buffer.getvalue())
    _gzip_bytes(folder / "barcodes.tsv.gz", "".join(f"{b}\n" for b in adata.obs_names).encode())
    features = zip(adata.var["gene_ids"], adata.var_names, adata.var["feature_types"], strict=True)
    _gzip_bytes(folder / "features.tsv.gz", "".join("\t".join(f) + "\n" for f in features).encode())


def write_10x_h5(adata: ad.AnnData, path: Path) -> None:
    """Cell Ranger v3 HDF5 layout (what ``scanpy.read_10x_h5`` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    csc = sparse.csr_matrix(adata.X, dtype=np.int32)  # cells x genes CSR = genes x cells CSC
    n_genes = adata.n_vars
    with h5py.File(path, "w") as f:
        m = f.create_group("matrix")
        m.create_dataset("barcodes", data=np.array(adata.obs_names, dtype="S"))
        m.create_dataset("data", data=csc.data, compression="gzip")  # as Cell Ranger writes it
        m.create_dataset("indices", data=csc.indices.astype(np.int64), compression="gzip")
        m.create_dataset("indptr", data=csc.indptr.astype(np.int64))
        m.create_dataset("shape", data=np.array([n_genes, adata.n_obs], dtype=np.int32))
        feats = m.create_group("features")
        feats.create_dataset("_all_tag_keys", data=np.array([b"genome"]))
        feats.create_dataset("feature_type", data=np.array(adata.var["feature_types"], dtype="S"))
        feats.create_dataset("genome", data=np.array([b"GRCh38"] * n_genes))
        feats.create_dataset("id", data=np.array(adata.var["gene_ids"], dtype="S"))
        feats.create_dataset("name", data=np.array(adata.var_names, dtype="S"))


def input_path(spec: SampleSpec, outdir: str | Path) -> Path:
    """Where a sample written into ``outdir`` keeps its counts (a folder for 10x mtx)."""
    return (Path(outdir) / INPUT_NAMES[spec.format]).resolve()


def write_sample(spec: SampleSpec, outdir: str | Path) -> Path:
    """Simulate ``spec`` into ``outdir`` (data, truth.tsv, synthetic.json); returns the input path."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    adata, truth = simulate(spec)
    target = input_path(spec, outdir)
    if spec.format == "mtx":
        write_10x_mtx(adata, target)
    elif spec.format == "h5":
        write_10x_h5(adata, target)
    else:
        adata.write_h5ad(target)
    truth.to_csv(outdir / TRUTH_FILE, sep="\t", index=False)
    record = {
        "generator": "agent.data.synthetic",
        "spec": asdict(spec),
        "input": INPUT_NAMES[spec.format],
        "n_barcodes": adata.n_obs,
        "n_genes": adata.n_vars,
    }
    if spec.condition_effect:  # the planted truth a test of conditions must find
        record["condition_effect"] = {
            "genes": list(CONDITION_GENES), "fold": CONDITION_FOLD,
            "cell_types": list(CONDITION_TYPES), "composition_factors": CONDITION_SHIFT,
        }  # fmt: skip
    (outdir / PARAMS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return target


def truth_path(data_path: str | Path) -> Path:
    """truth.tsv beside a sample's data (inside a 10x mtx folder, or next to a file)."""
    data_path = Path(data_path)
    return (data_path if data_path.is_dir() else data_path.parent) / TRUTH_FILE


def load_truth(data_path: str | Path) -> pd.DataFrame:
    """The planted truth of a synthetic sample, indexed by barcode."""
    path = truth_path(data_path)
    if not path.is_file():
        raise FileNotFoundError(f"no {TRUTH_FILE} beside {data_path} (expected {path})")
    return pd.read_csv(path, sep="\t", index_col="barcode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--outdir", required=True, help="folder to write into")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--sample", choices=list(DEMO_COHORT), help="one demo sample, into OUTDIR")
    which.add_argument("--cohort", action="store_true", help="every demo sample, into OUTDIR/NAME/")
    which.add_argument("--cells", type=int, help="a custom sample with this many cell barcodes")
    custom = parser.add_argument_group("custom sample (with --cells)")
    custom.add_argument("--name", default="custom", help="the sample's name")
    custom.add_argument("--seed", type=int, default=0, help="seed of the random draws")
    custom.add_argument("--damaged", type=float, default=0.08, help="fraction of damaged singlets")
    custom.add_argument("--doublets", type=float, default=0.05, help="fraction of doublet barcodes")
    custom.add_argument("--empty", type=float, default=0.08, help="empty barcodes per cell barcode")
    custom.add_argument("--median-umis", type=float, default=4000.0, help="median UMIs per cell")
    custom.add_argument(
        "--ambient", type=float, default=0.0, help="mean share of each cell's UMIs from ambient RNA"
    )
    custom.add_argument("--format", choices=FORMATS, default="mtx", help="file format written")


def main(args: argparse.Namespace) -> int:
    outdir = Path(args.outdir)
    if args.cohort:
        jobs = [(spec, outdir / name) for name, spec in DEMO_COHORT.items()]
    elif args.sample:
        jobs = [(DEMO_COHORT[args.sample], outdir)]
    else:
        try:
            spec = SampleSpec(
                args.name, args.cells, seed=args.seed, damaged_fraction=args.damaged,
                doublet_fraction=args.doublets, empty_fraction=args.empty,
                median_umis=args.median_umis, ambient_fraction=args.ambient, format=args.format,
            )  # fmt: skip
        except ValueError as e:
            say.error(f"{e}")
            return 2
        jobs = [(spec, outdir)]
    for spec, folder in jobs:
        try:
            path = write_sample(spec, folder)
        except OSError as e:  # a folder that cannot be made or written: one line, not a traceback
            say.error(f"cannot write {spec.name} into {folder}: {e}")
            return 1
        print(json.dumps({"sample": spec.name, "input": str(path), "truth": str(truth_path(path))}))
    return 0

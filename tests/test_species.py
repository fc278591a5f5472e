"""Species from gene symbols, and the QC patterns that follow from it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from agent.tools.qc import gene_masks
from agent.tools.species import detect_species, symbol_rules

HUMAN = ["CD3E", "MT-CO1", "RPL13", "HBB", "HLA-DRA", "LINC00115", "AL627309.1"]
MOUSE = ["Cd3e", "mt-Co1", "Rpl13", "Hbb-bs", "H2-Aa", "Gm26917", "4933401J01Rik"]


@pytest.mark.parametrize(
    ("names", "species"),
    [
        (HUMAN, "human"),
        (MOUSE, "mouse"),
        (["ENSMUSG00000000001", "ENSMUSG00000000028", "Cd3e"], "mouse"),
        (["ENSG00000141510", "ENSG00000012048"], "human"),
        (["1", "2", "3"], "unknown"),
        ([], "unknown"),
    ],
)
def test_detect_species(names, species):
    found = detect_species(names)
    assert found["species"] == species and found["evidence"]


@pytest.mark.parametrize("names", [HUMAN, MOUSE])
def test_each_species_rules_find_mt_ribo_and_hb_genes(names):
    species = detect_species(names)["species"]
    rules = symbol_rules(species)
    masks = gene_masks(names, rules.mt_prefix, rules.ribo_pattern, rules.hb_pattern)
    assert [names[i] for i, m in enumerate(masks["mt"]) if m] == [names[1]]
    assert masks["ribo"].sum() == 1 and masks["hb"].sum() == 1
    # symbols that differ only in case match either species' rules
    assert (gene_masks(names)["mt"] == masks["mt"]).all()
    assert symbol_rules("unknown") == symbol_rules("human")


# Ensembl/HGNC symbols: the haemoglobins and cytoplasmic ribosomal proteins, then look-alikes a
# prefix takes (HBEGF: a growth factor; HBP1, HBS1L: not globins; RPS6KA1, RPS6KB1: kinases;
# RPL7L1: a ribosome biogenesis factor; RPL3L, RPL39L: muscle/testis paralogs; RPL13AP5, HBBP1,
# RPSAP58: pseudogenes; RPS19BP1: a binding protein)
HB = ["HBA1", "HBA2", "HBB", "HBD", "HBE1", "HBG1", "HBG2", "HBM", "HBQ1", "HBZ"]
RIBO = ["RPL3", "RPL13A", "RPL36A", "RPLP0", "RPLP2", "RPS4X", "RPS4Y1", "RPS27A", "RPSA"]
NEITHER = ["HBEGF", "HBP1", "HBS1L", "HBBP1", "RPS6KA1", "RPS6KB1", "RPL7L1", "RPL3L",
           "RPL39L", "RPL13AP5", "RPSAP58", "RPS19BP1", "MRPL13", "CD3E"]  # fmt: skip
MOUSE_HB = ["Hba-a1", "Hba-a2", "Hba-x", "Hbb-bs", "Hbb-bt", "Hbb-y", "Hbb-bh1", "Hbq1a"]
MOUSE_RIBO = ["Rpl13a", "Rplp0", "Rps4x", "Rpsa", "Rps27a"]
MOUSE_NEITHER = ["Hbegf", "Hbp1", "Hba-ps3", "Rps6ka1", "Rpl7l1", "Rpl10-ps3", "Mrpl13"]


@pytest.mark.parametrize(
    ("species", "hb", "ribo", "neither"),
    [("human", HB, RIBO, NEITHER), ("mouse", MOUSE_HB, MOUSE_RIBO, MOUSE_NEITHER)],
)
def test_patterns_take_only_haemoglobin_and_ribosomal_protein_genes(species, hb, ribo, neither):
    rules = symbol_rules(species)
    names = hb + ribo + neither
    masks = gene_masks(names, rules.mt_prefix, rules.ribo_pattern, rules.hb_pattern)
    assert [g for g, m in zip(names, masks["hb"], strict=True) if m] == hb
    assert [g for g, m in zip(names, masks["ribo"], strict=True) if m] == ribo


def test_real_gene_list_has_the_ten_haemoglobins():
    """CellTypist's sample holds the whole 10x human gene list (32,786 genes)."""
    celltypist = pytest.importorskip("celltypist")
    sample = Path(celltypist.__file__).parent / "data/samples/sample_cell_by_gene.csv"
    names = pd.read_csv(sample, nrows=0, index_col=0).columns
    masks = gene_masks(names)
    assert sorted(names[masks["hb"]]) == sorted(HB)
    ribo = set(names[masks["ribo"]])
    assert {"RPLP0", "RPLP1", "RPLP2", "RPSA", "RPS4Y1", "RPL13A"} <= ribo
    assert not ribo & {"RPS6KA1", "RPL7L1", "RPL3L", "RPSAP58", "RPS19BP1", "RPL36A-HNRNPH2"}
    assert 78 <= len(ribo) <= 84  # the cytoplasmic ribosomal protein genes (+ RPS4Y1/2)

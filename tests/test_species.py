"""Species from gene symbols, and the QC patterns that follow from it."""

from __future__ import annotations

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
    masks = gene_masks(names, rules.mt_prefix, rules.ribo_prefixes, rules.hb_pattern)
    assert [names[i] for i, m in enumerate(masks["mt"]) if m] == [names[1]]
    assert masks["ribo"].sum() == 1 and masks["hb"].sum() == 1
    # symbols that differ only in case match either species' rules
    assert (gene_masks(names)["mt"] == masks["mt"]).all()
    assert symbol_rules("unknown") == symbol_rules("human")

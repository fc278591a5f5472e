"""Which species a sample's gene symbols come from, and the gene-symbol rules that follow from it.

Human symbols are upper case (CD3E, MT-CO1), mouse symbols title case (Cd3e, mt-Co1): HGNC and
MGI conventions, which 10x references and most count matrices keep. The casing of the symbols
decides; Ensembl ids (ENSG/ENSMUSG) decide where symbols are missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

HUMAN, MOUSE, UNKNOWN = "human", "mouse", "unknown"
MIN_SHARE = 0.6  # of the letter-bearing symbols, in one species' casing


@dataclass(frozen=True)
class SymbolRules:
    """Gene-set patterns for QC, per species (scanpy tutorial's rules, in that species' casing)."""

    mt_prefix: str
    ribo_prefixes: tuple[str, ...]
    hb_pattern: str


RULES = {
    HUMAN: SymbolRules("MT-", ("RPS", "RPL"), r"^HB[^(P)]"),
    MOUSE: SymbolRules("mt-", ("Rps", "Rpl"), r"^Hb[^(p)]"),
}


def detect_species(names: Any) -> dict[str, Any]:
    """{"species": human|mouse|unknown, "evidence": why} from gene symbols or Ensembl ids."""
    names = pd.Index(names).astype(str)
    if len(names) == 0:
        return {"species": UNKNOWN, "evidence": "no genes"}
    ensembl = names.str.extract(r"^(ENSMUSG|ENSG)\d", expand=False).value_counts()
    if ensembl.sum() > len(names) / 2:
        species = MOUSE if ensembl.idxmax() == "ENSMUSG" else HUMAN
        return {"species": species, "evidence": f"{int(ensembl.max())} {ensembl.idxmax()} ids"}
    letters = names[names.str.contains(r"[A-Za-z]{2}", regex=True)]
    upper = int(letters.str.fullmatch(r"[^a-z]+").sum())
    title = int(letters.str.fullmatch(r"[A-Z][^A-Z]*[a-z][^A-Z]*|mt-[A-Z][^A-Z]*").sum())
    n = max(1, len(letters))
    evidence = f"{upper} of {len(letters)} symbols upper case, {title} title case"
    if upper / n >= MIN_SHARE:
        return {"species": HUMAN, "evidence": evidence}
    if title / n >= MIN_SHARE:
        return {"species": MOUSE, "evidence": evidence}
    return {"species": UNKNOWN, "evidence": evidence}


def symbol_rules(species: str) -> SymbolRules:
    """QC patterns for a species; unknown species get the human ones, matched case-insensitively
    by the callers (agent.tools.qc.gene_masks)."""
    return RULES.get(species, RULES[HUMAN])

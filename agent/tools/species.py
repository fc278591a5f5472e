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
    """Gene-set patterns for QC, per species, in that species' casing (matched ignoring case).

    The patterns name each set's genes exactly: prefixes would also take HBEGF, HBP1, HBS1L (not
    haemoglobins) and RPS6KA1-6, RPS6KB1 (kinases), pseudogenes (RPL13AP5, HBBP1) and the -like
    paralogs (RPL7L1, a ribosome biogenesis factor; RPL3L, RPL10L, RPL39L: muscle and testis).
    """

    mt_prefix: str
    # the 80 cytoplasmic ribosomal protein genes: RPL/RPS + number (+ A, X, Y variants), the
    # stalk proteins RPLP0-2 and RPSA
    ribo_pattern: str
    # alpha, beta, delta, epsilon, gamma, mu, theta and zeta globins (human HBA1 ... HBZ; mouse
    # Hba-a1, Hba-x, Hbb-bs, Hbb-y, Hbq1a ...), not their pseudogenes
    hb_pattern: str
    # prefixes of genes that follow cell size and quality, not type (left out of marker lists)
    ribo_prefixes: tuple[str, ...]


RULES = {
    HUMAN: SymbolRules(
        "MT-", r"^RP(?:[SL]\d+[AXY]?\d*|LP[0-2]|SA)$", r"^HB[ABDEGMQZ]\d?$", ("RPS", "RPL")
    ),
    MOUSE: SymbolRules(
        "mt-",
        r"^Rp(?:[sl]\d+[axy]?\d*|lp[0-2]|sa)$",
        r"^Hb(?:a-(?:a\d|x)|b-(?:b[st\d]|bh\d|y)|q1[ab])$",
        ("Rps", "Rpl"),
    ),
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

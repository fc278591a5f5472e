"""Which samples a comparison of conditions can use: their condition from the sample sheet, the
reference level, and every sample left out with why.

A condition is a sheet column (`condition`, or the one config `conditions.column` names); a
sample without a value there, or whose condition has fewer than ``min_samples`` usable samples,
is left out by name with the reason, never silently. The reference is the level the others are
compared with: the one given, else the first in sheet order.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Design:
    """The comparison: ``samples`` (sample -> condition) used, ``reference`` first in
    ``levels``; ``left_out`` (sample -> why); ``statement`` says why there is no comparison
    (None when there is one)."""

    column: str
    samples: dict[str, str]
    levels: list[str]
    reference: str | None
    min_samples: int
    left_out: dict[str, str] = field(default_factory=dict)
    statement: str | None = None

    @property
    def testable(self) -> bool:
        return self.statement is None

    def to_json(self) -> dict:
        return {
            "column": self.column, "reference": self.reference, "levels": self.levels,
            "min_samples": self.min_samples, "samples": self.samples, "left_out": self.left_out,
            "statement": self.statement,
        }  # fmt: skip


def design(
    samples: list[str],
    cells: dict[str, dict[str, str]],
    column: str | None,
    min_samples: int = 2,
    reference: str | None = None,
    left_out: dict[str, str] | None = None,
) -> Design:
    """The comparison of the conditions in ``column`` among ``samples`` (in sheet order), each
    condition with at least ``min_samples`` samples; ``left_out``: samples already left out."""
    left = dict(left_out or {})
    if not column:
        return Design("", {}, [], None, min_samples, left, "no condition column configured")
    if not any(cells.get(s, {}).get(column) for s in samples):
        statement = f"no sample has a value in the sheet's column {column!r}"
        return Design(column, {}, [], None, min_samples, left, statement)
    of = {}
    for s in samples:
        value = cells.get(s, {}).get(column)
        if value:
            of[s] = value
        else:
            left[s] = f"no value in the sheet's column {column!r}"
    levels = list(dict.fromkeys(of.values()))
    count = {level: sum(v == level for v in of.values()) for level in levels}
    few = [level for level in levels if count[level] < min_samples]
    for s, value in list(of.items()):
        if value in few:
            left[s] = f"condition {value!r} has {count[value]} sample(s), fewer than {min_samples}"
            del of[s]
    levels = [level for level in levels if level not in few]
    if reference and reference not in count:
        statement = f"reference condition {reference!r} is not in column {column!r}"
    elif reference and reference in few:
        statement = f"reference condition {reference!r} has fewer than {min_samples} samples"
    elif len(levels) < 2:
        statement = (
            f"fewer than 2 conditions in column {column!r} with at least {min_samples} samples "
            f"each ({', '.join(f'{k}: {v}' for k, v in count.items()) or 'no values'})"
        )
    else:
        statement = None
    ref = reference or (levels[0] if levels else None)
    if ref in levels:
        levels = [ref, *[level for level in levels if level != ref]]
    return Design(column, of, levels, ref, min_samples, left, statement)

"""The world state: the exact record of every finished tool call, and its prompt rendering.

The artifact (world_state.json) keeps every entry whole. The prompt carries it as a full compact
rendering (``render``: recent calls as their lines, older ones one line per tool, older errors as
steps), written at the start and after each cut of the history, and then one line per entry
(``line``) beside the entry's tool result (agent/context.py); nothing of it is truncated.

Each saved entry carries ``chain``, a hash over the previous entry's chain and its own content, and
a record saved with a final status carries ``meta.seal``, a hash over the last chain and meta: an
entry altered or removed, or meta edited, afterwards shows (agent/record/integrity.py checks them).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import orjson

from agent.record.durable import RecordWriter
from agent.record.layout import SampleLayout
from agent.record.models import ENTRY_KEYS, RunMeta, StepEntry
from agent.registry import Outcome

SCHEMA_VERSION = 1
# meta.record_version: 2 = every entry chained and a final meta sealed, and load_data naming the
# run's input as "<input>" (by role; its content is meta.input_sha256); absent = 1, made before.
RECORD_VERSION = 2


def record_version(meta: dict[str, Any]) -> int:
    """The version a record was begun with (1: before the field existed)."""
    return int(meta.get("record_version", 1))


HEADER = "WORLD STATE:"  # the full rendering's first words
LINE_WIDTH = 160  # characters of an entry's line
_OPTS = orjson.OPT_SERIALIZE_NUMPY


@dataclass(kw_only=True)
class Entry(Outcome):
    """One finished tool call as the record keeps it: the call's outcome, its place in the run
    and the data digests around it."""

    step: int
    digest_before: str | None
    digest_after: str | None
    call_id: str | None = None
    checkpoint: str | None = None
    # Set when the entry is first encoded for saving, or as loaded. Not an argument, so a copy
    # made with dataclasses.replace (other content) gets its own chain.
    chain: str | None = field(default=None, init=False, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The record's form: the keys in the order records have always had them, and
        ``rejected_arguments`` only on a call refused before it ran."""
        doc = {name: getattr(self, name) for name in ENTRY_KEYS}
        if self.rejected_arguments is not None:
            doc["rejected_arguments"] = self.rejected_arguments
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Entry:
        doc = dict(doc)
        chain = doc.pop("chain", None)
        params = doc.get("params") or {}
        if set(params) == {"_raw"}:  # records before rejected_arguments had its own field
            doc.update(params={}, rejected_arguments=params["_raw"])
        entry = cls(**doc)
        entry.chain = chain
        return entry


def plain(doc: Any) -> Any:
    """``doc`` as the record reads back (numpy values as JSON numbers, NaN as null): the hashes
    are of what a reader of the file sees."""
    return orjson.loads(orjson.dumps(doc, option=_OPTS))


def link(previous: str, doc: Any) -> str:
    """sha256 of ``previous`` (a chain in hex, or "") followed by the canonical JSON (sorted keys)
    of ``doc``, a plain JSON value."""
    body = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(previous.encode() + body).hexdigest()


def seal(meta: dict[str, Any], last_chain: str) -> str:
    """The seal of a record's meta (without its ``seal``) after the entry whose chain is given."""
    return link(last_chain, plain({k: v for k, v in meta.items() if k != "seal"}))


def _short(value: Any, width: int) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, str):
        text = value
    else:
        # Past `width` items the text is cut anyway (an item is over one character): the same
        # shown prefix without encoding a 200 KB table for a 40-character preview.
        if isinstance(value, list) and len(value) > width:
            value = value[:width]
        elif isinstance(value, dict) and len(value) > width:
            value = dict(islice(value.items(), width))
        text = orjson.dumps(value).decode()
    return text if len(text) <= width else text[: width - 1] + "…"


def _kv(d: dict[str, Any] | None, width: int, numbers_only: bool = False, limit: int = 99) -> str:
    items = []
    for k, v in (d or {}).items():
        if numbers_only and (isinstance(v, bool) or not isinstance(v, int | float)):
            continue
        items.append(f"{k}={_short(v, width)}")
    return ", ".join(items[:limit])


@dataclass
class WorldState:
    meta: dict[str, Any] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    _encoded: list[bytes] = field(default_factory=list, repr=False, compare=False)
    _writer: RecordWriter | None = field(default=None, repr=False, compare=False)
    # the rendering's fold of the older entries: how many, latest ok per tool (x calls), errors
    _folded: int = field(default=0, repr=False, compare=False)
    _latest: dict[str, tuple[Entry, int]] = field(default_factory=dict, repr=False, compare=False)
    _errors: list[str] = field(default_factory=list, repr=False, compare=False)

    @property
    def next_step(self) -> int:
        return self.entries[-1].step + 1 if self.entries else 1

    def add(self, entry: Entry) -> Entry:
        self.entries.append(entry)
        return entry

    def last_ok(self, tool: str) -> Entry | None:
        return next(
            (e for e in reversed(self.entries) if e.tool == tool and e.status == "ok"), None
        )

    def line(self, e: Entry, defaults: dict[str, dict[str, Any]] | None = None) -> str:
        """One entry as one short line, the same in the full rendering and beside the entry's tool
        result in the prompt: ``#step tool(params) -> numbers`` (or ``-> ERROR why``), parameters
        left at their ``defaults`` (per tool) hidden."""
        if e.rejected_arguments is not None:  # what was sent, so the model sees its mistake
            shown = _short(e.rejected_arguments, 60)
        else:
            left_out = (defaults or {}).get(e.tool, {})
            shown = _kv({k: v for k, v in e.params.items() if left_out.get(k, object()) != v}, 16)
        if e.status == "ok":
            outcome = _kv(e.result, 10, numbers_only=True, limit=6) or "ok"
        else:
            outcome = f"ERROR {e.error}"
        text = " ".join(f"#{e.step} {e.tool}({shown}) -> {outcome}".split())  # one line
        return text if len(text) <= LINE_WIDTH else text[: LINE_WIDTH - 1] + "…"

    def render(self, recent: int = 3, defaults: dict[str, dict[str, Any]] | None = None) -> str:
        """The full compact rendering for the prompt. ``defaults`` (per tool) hides parameters
        left at default.

        The latest calls appear as their lines; older ones one line per tool (its latest
        successful call and how many calls), older errors as a list of steps: under 1,000 tokens
        for a 60-step analysis. Incremental: the older part is kept folded, so a rendering costs
        the entries added since the one before plus one line per tool, not a scan of them all.
        """
        cut = max(len(self.entries) - recent, 0)
        self._fold(cut)
        lines = [f"{HEADER} {len(self.entries)} tool calls done (authoritative record)."]
        if self._latest:
            lines.append("Earlier (latest successful call per tool):")
        for e, n in sorted(self._latest.values(), key=lambda t: t[0].step):
            lines.append(self.line(e, defaults) + (f" ({n} calls)" if n > 1 else ""))
        if self._errors:
            lines.append(f"Earlier errors at steps {', '.join(self._errors[-8:])} (see record).")
        if cut < len(self.entries):
            lines.append("Latest:")
        lines += [self.line(e, defaults) for e in self.entries[cut:]]
        return "\n".join(lines)

    def _fold(self, cut: int) -> None:
        """Fold entries[:cut] into the per-tool summary (only those not folded yet). Entries are
        only ever appended, so what is folded stays true; a list rebuilt from scratch folds anew."""
        if cut < self._folded:
            self._folded, self._latest, self._errors = 0, {}, []
        for e in self.entries[self._folded : cut]:
            if e.status == "ok":
                self._latest[e.tool] = (e, self._latest.get(e.tool, (e, 0))[1] + 1)
            elif e.status == "error":
                self._errors.append(str(e.step))
        self._folded = max(self._folded, cut)

    def _head(self) -> bytes:
        """Schema version and meta, sealed anew when the status is final. Not while running:
        the loop's step saves must keep one head for RecordWriter to append."""
        meta = {k: v for k, v in self.meta.items() if k != "seal"}
        if meta.get("status", "running") != "running":
            self._encode()
            meta.update(
                RunMeta.part(seal=seal(meta, self.entries[-1].chain if self.entries else ""))
            )
        head = orjson.dumps({"schema_version": SCHEMA_VERSION, "meta": meta}, option=_OPTS)
        return head[:-1] + b',"entries":['

    def _encode(self) -> None:
        """Encode the entries not encoded yet. Entries are final once saved, so their encoding
        is kept: a save encodes only the new ones, and each gets its chain then."""
        for entry in self.entries[len(self._encoded) :]:
            doc = plain(entry.to_json())
            if entry.chain is None:  # one loaded keeps its own: an alteration must stay visible
                StepEntry.model_validate(doc)  # written once, so checked once
                previous = self.entries[len(self._encoded) - 1].chain if self._encoded else ""
                entry.chain = link(previous or "", doc)
            self._encoded.append(orjson.dumps({**doc, "chain": entry.chain}))

    def _chunks(self, start: int = 0) -> list[bytes]:
        """Entries from `start` on, comma-separated, and the closing brackets."""
        self._encode()
        chunks = []
        for i in range(start, len(self._encoded)):
            chunks += [b",", self._encoded[i]] if i else [self._encoded[i]]
        return [*chunks, b"]}"]

    def to_json(self) -> bytes:
        return b"".join([self._head(), *self._chunks()])

    def save_record(self, layout: SampleLayout, step: bool = False) -> None:
        """Publish the record and its copy beside the checkpoints (see RecordWriter). A step save
        (``step=True``, the loop's) appends only the entries added since the save before."""
        paths = (layout.record, (layout.record_copy,))
        if self._writer is None or (self._writer.path, self._writer.copies) != paths:
            if self._writer is not None:
                self._writer.flush()
            self._writer = RecordWriter(*paths)
        self._writer.save(self._head(), len(self.entries), self._chunks, append=step)

    @classmethod
    def load(cls, path: str | Path) -> WorldState:
        try:
            doc = orjson.loads(Path(path).read_bytes())
            return cls(meta=doc["meta"], entries=[Entry.from_json(e) for e in doc["entries"]])
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a readable world state ({type(e).__name__}: {e})") from e

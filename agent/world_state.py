"""The world state: the exact record of every finished tool call, and its prompt rendering.

The artifact (world_state.json) keeps every entry whole. The rendering for the prompt is never
truncated by the context manager; it stays small by compacting older entries instead: recent
calls in full, older ones one line per tool (latest call, how many times), older errors counted.

Each saved entry carries ``chain``, a hash over the previous entry's chain and its own content, and
a record saved with a final status carries ``meta.seal``, a hash over the last chain and meta: an
entry altered or removed, or meta edited, afterwards shows (agent/integrity.py checks them).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import orjson

from agent.durable import RecordWriter
from agent.layout import SampleLayout
from agent.registry import Outcome

SCHEMA_VERSION = 1
_OPTS = orjson.OPT_SERIALIZE_NUMPY
_ENTRY_KEYS = (
    "step", "tool", "params", "status", "result", "error", "seconds", "digest_before",
    "digest_after", "call_id", "checkpoint",
)  # fmt: skip


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
        doc = {name: getattr(self, name) for name in _ENTRY_KEYS}
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

    def render(self, recent: int = 3, defaults: dict[str, dict[str, Any]] | None = None) -> str:
        """Compact text for the prompt. `defaults` (per tool) hides parameters left at default.

        The latest calls appear whole (results cut at a few hundred characters); older ones one
        line per tool (its latest successful call, its numbers, how many calls), older errors
        as a list of steps: under 1,000 tokens for a 60-step analysis.
        """
        defaults = defaults or {}

        def params(e: Entry) -> str:
            left_out = defaults.get(e.tool, {})
            if e.rejected_arguments is not None:  # what was sent, so the model sees its mistake
                return _short(e.rejected_arguments, 60)
            shown = {k: v for k, v in e.params.items() if left_out.get(k, object()) != v}
            return _kv(shown, 16)

        cut = max(len(self.entries) - recent, 0)
        old, new = self.entries[:cut], self.entries[cut:]
        lines = [f"WORLD STATE: {len(self.entries)} tool calls done (authoritative record)."]
        latest: dict[str, tuple[Entry, int]] = {}
        for e in old:
            if e.status == "ok":
                latest[e.tool] = (e, latest.get(e.tool, (e, 0))[1] + 1)
        if latest:
            lines.append("Earlier (latest successful call per tool):")
        for e, n in sorted(latest.values(), key=lambda t: t[0].step):
            times = f" x{n}" if n > 1 else ""
            numbers = _kv(e.result, 10, numbers_only=True, limit=4)
            lines.append(f"#{e.step} {e.tool}({params(e)}){times} -> {numbers}"[:120])
        errors = [str(e.step) for e in old if e.status == "error"]
        if errors:
            lines.append(f"Earlier errors at steps {', '.join(errors[-8:])} (see record).")
        if new:
            lines.append("Latest:")
        for e in new:
            outcome = _kv(e.result, 40)[:240] if e.status == "ok" else f"ERROR {e.error}"[:240]
            lines.append(f"#{e.step} {e.tool}({params(e)}) -> {outcome}")
        return "\n".join(lines)

    def _head(self) -> bytes:
        """Schema version and meta, sealed anew when the status is final. Not while running:
        the loop's step saves must keep one head for RecordWriter to append."""
        meta = {k: v for k, v in self.meta.items() if k != "seal"}
        if meta.get("status", "running") != "running":
            self._encode()
            meta["seal"] = seal(meta, self.entries[-1].chain if self.entries else "")
        head = orjson.dumps({"schema_version": SCHEMA_VERSION, "meta": meta}, option=_OPTS)
        return head[:-1] + b',"entries":['

    def _encode(self) -> None:
        """Encode the entries not encoded yet. Entries are final once saved, so their encoding
        is kept: a save encodes only the new ones, and each gets its chain then."""
        for entry in self.entries[len(self._encoded) :]:
            doc = plain(entry.to_json())
            if entry.chain is None:  # one loaded keeps its own: an alteration must stay visible
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
            self._writer = RecordWriter(*paths)
        self._writer.save(self._head(), len(self.entries), self._chunks, append=step)

    @classmethod
    def load(cls, path: str | Path) -> WorldState:
        try:
            doc = orjson.loads(Path(path).read_bytes())
            return cls(meta=doc["meta"], entries=[Entry.from_json(e) for e in doc["entries"]])
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a readable world state ({type(e).__name__}: {e})") from e

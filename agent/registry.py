"""The tool registry: typed Python functions in, JSON schemas and safe calls out.

A tool is a plain function whose first parameter is the run's session and whose other
parameters are keyword arguments with type hints (ranges via ``Annotated[float, Field(ge=..)]``,
choices via ``Literal``). Its docstring's first paragraph describes it to the model; parameter
descriptions come from ``Field(description=...)`` or from the docstring's Args/Parameters
section. A call raises only for a fault of the machine, not of the analysis (InfrastructureError:
an I/O error, a full disk, memory exhausted): a retry of the job resumes it. Every other failure
becomes an error ``Outcome`` that the model reads and the record keeps.

What the rest of the project needs to know about a tool (what must have succeeded before it, whether
it is worth a checkpoint, whether it changes the data, what kind of step it is) is declared once, by
the ``@tool(...)`` decorator on the function; the registry refuses a function without it, and
finds a module's tools by it (``declared_tools``).
"""

from __future__ import annotations

import errno
import functools
import importlib
import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import docstring_parser
import orjson
from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic.fields import FieldInfo

from agent import signals
from agent.checks import check


class ToolError(Exception):
    """A failure the model should read and can act on (wrong order, bad input, bad value)."""


class Refusal(ToolError):
    """A decision a check refused (agent/checks.py): the model reads the message; the error
    entry keeps the check in its result, so the record says what was refused and why."""

    def __init__(self, check: dict[str, Any]):
        super().__init__(check["message"])
        self.check = check


class InfrastructureError(Exception):
    """The machine failed the run (I/O error, full disk, no memory): not a result of the
    analysis, so it is not recorded as one; the run stops and a retry resumes it."""


# errno values that say the storage or the machine failed, not the request: a file that is not
# there or not readable (ENOENT, EACCES, EISDIR...) is the call's own mistake and stays a result.
INFRASTRUCTURE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EIO", "ENOSPC", "EDQUOT", "ESTALE", "ENOMEM", "EROFS", "ENOLCK", "ETIMEDOUT",
                 "EMFILE", "ENFILE", "EREMOTEIO", "ECOMM")
    if hasattr(errno, name)
)  # fmt: skip


def infrastructure_fault(e: BaseException) -> BaseException | None:
    """The machine fault behind ``e``, if any: ``e`` or an exception it was raised from or while
    handling (tools turn reader errors into readable ToolErrors, keeping the original as context)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, MemoryError) or (
            isinstance(seen, OSError) and seen.errno in INFRASTRUCTURE_ERRNOS
        ):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# The kind of step a tool is. "load", "cell_calling" and "finish" are one tool each: the loop and
# resume know the tool that reads the input, decides there are cells and ends the run by its kind
# (agent/tool_declarations.py).
Kind = Literal[
    "load", "cell_calling", "qc", "cell_filter", "gene_filter", "doublets", "preprocess", "embed",
    "cluster", "ambient", "markers", "annotate", "plot", "save", "finish",
]  # fmt: skip

# The stages of a complete analysis, in order. A tool declares the stage it reaches (``@tool(...,
# stage=...)``); ``finish`` succeeds only when every stage was reached on the current data.
Stage = Literal[
    "cells", "qc", "cell_filter", "doublets", "normalised", "hvg", "pca", "neighbours",
    "clusters", "markers", "labels",
]  # fmt: skip
STAGES: tuple[Stage, ...] = get_args(Stage)
# The obs column a stage must be written to: the final object's readers (the report, cohort
# integration, agent compare) take the labels from there.
STAGE_COLUMNS: dict[Stage, str] = {"labels": "cell_type"}


@dataclass(frozen=True)
class ToolSpec:
    """A tool's metadata, declared with ``@tool`` next to the function."""

    kind: Kind
    # Tools that must have succeeded (since the data were loaded) before this one runs; a
    # function of the validated parameters where that depends on them (e.g. the kind of plot).
    needs: tuple[str, ...] | Callable[[dict[str, Any]], tuple[str, ...]] = ()
    expensive: bool = False  # seconds to minutes to recompute: worth a checkpoint of its own
    mutates: bool = True  # changes the data; False: never a checkpoint, not an analysis choice
    stage: Stage | None = None  # the stage of an analysis a success reaches (STAGES)
    # The first stage a success makes stale, with every stage after it: the tool changed the
    # cells, genes or values those were computed from, so they must be reached again.
    resets: Stage | None = None
    # The parameter naming the clustering (obs column) the tool writes (stage "clusters") or
    # reads (a later stage): such a stage counts only for the current clustering.
    clustering: str | None = None
    # Evidence thresholds among the parameters, and the direction that loosens each ("lower":
    # a minimum the evidence must reach): set looser than the default, the result warns.
    loosens: Mapping[str, Literal["lower", "higher"]] = field(default_factory=dict)

    def needs_for(self, params: dict[str, Any]) -> tuple[str, ...]:
        return self.needs(params) if callable(self.needs) else self.needs


def tool(
    kind: Kind,
    needs: tuple[str, ...] | Callable[[dict[str, Any]], tuple[str, ...]] = (),
    expensive: bool = False,
    mutates: bool = True,
    stage: Stage | None = None,
    resets: Stage | None = None,
    clustering: str | None = None,
    loosens: Mapping[str, Literal["lower", "higher"]] | None = None,
) -> Callable[[Callable[..., dict[str, Any]]], Callable[..., dict[str, Any]]]:
    """Declare a function a tool. Whoever calls it (the loop, a resume re-running recorded steps,
    a replay, a test), it first checks ``needs`` against ``session.done`` and, when it returns,
    adds its own name there and tells the session the stage it reached or made stale
    (``session.reached``), so prerequisites and ``finish`` always see the truth."""
    spec = ToolSpec(kind, needs, expensive, mutates, stage, resets, clustering, loosens or {})

    def wrap(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        defaults = {
            name: p.default
            for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty
        }

        @functools.wraps(fn)
        def run(session: Any, **params: Any) -> dict[str, Any]:
            needs = spec.needs_for(params)
            if needs:
                session.require(fn.__name__, *needs)
            given = {**defaults, **params}  # a direct call (not the registry's) may leave some out
            written = given.get("key_added")
            if spec.clustering and spec.stage != "clusters" and written == given[spec.clustering]:
                raise ToolError(
                    f"{fn.__name__}: key_added={written!r} would overwrite the clustering it "
                    f"reads ({spec.clustering}={written!r}): name another column"
                )
            found = evidence_settings(fn.__name__, spec.loosens, defaults, given)
            result = fn(session, **params)
            if found is not None:
                result = {**result, "checks": [*result.get("checks", []), found]}
            session.done.add(fn.__name__)
            if spec.stage or spec.resets:
                session.reached(fn.__name__, spec, given)
            return result

        run.spec = spec  # type: ignore[attr-defined]
        return run

    return wrap


def declared_tools(modules: Iterable[str]) -> list[Callable[..., dict[str, Any]]]:
    """The functions the named modules declare with ``@tool``: module by module, each one's in
    source order (a module's namespace keeps the order of definition; a tool it imports is the
    other module's)."""
    found = []
    for name in modules:
        found += [
            fn
            for fn in vars(importlib.import_module(name)).values()
            if isinstance(getattr(fn, "spec", None), ToolSpec) and fn.__module__ == name
        ]
    return found


def evidence_settings(
    tool: str,
    loosens: Mapping[str, str],
    defaults: Mapping[str, Any],
    params: Mapping[str, Any],
) -> dict[str, Any] | None:
    """The evidence_settings check of a call: which evidence thresholds it set looser than
    their defaults (both values named); None for a tool without evidence thresholds."""
    if not loosens:
        return None
    loose = {
        name: {"given": params[name], "default": defaults[name]}
        for name, looser in loosens.items()
        if params.get(name) is not None
        and defaults.get(name) is not None
        and params[name] != defaults[name]
        and (params[name] < defaults[name]) == (looser == "lower")
    }
    if loose:
        said = ", ".join(f"{k}={v['given']} (default {v['default']})" for k, v in loose.items())
        return check(
            "evidence_settings", "warn", f"{tool}: evidence thresholds loosened: {said}",
            loosened=loose,
        )  # fmt: skip
    return check("evidence_settings", "pass", f"{tool}: evidence thresholds at or above defaults")


@dataclass
class Outcome:
    tool: str
    params: dict[str, Any]  # exactly as the tool ran, defaults filled in ({} when rejected)
    status: Literal["ok", "error"]
    result: dict[str, Any] | None
    error: str | None
    seconds: float
    rejected_arguments: Any = None  # the arguments as sent, when they failed validation

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def for_model(self) -> dict[str, Any]:
        """What goes back to the model as the tool message: the result less the checks that
        passed (the record keeps them; the model needs what warned), or the error."""
        if not self.ok:
            return {"error": self.error}
        result = self.result or {}
        checks = result.get("checks")
        if not isinstance(checks, list):
            return result
        doubts = [c for c in checks if not (isinstance(c, dict) and c.get("verdict") == "pass")]
        return {k: v for k, v in result.items() if k != "checks"} | (
            {"checks": doubts} if doubts else {}
        )


@dataclass
class _Tool:
    fn: Callable[..., dict[str, Any]]
    model: type[BaseModel]
    schema: dict[str, Any]
    spec: ToolSpec


def _strip_titles(node: Any) -> Any:
    """Pydantic adds a title to every property; the model does not need them (tokens)."""
    if isinstance(node, dict):
        return {
            k: _strip_titles(v) for k, v in node.items() if k != "title" or not isinstance(v, str)
        }
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


def jsonable(value: Any) -> Any:
    """Plain JSON types only (numpy scalars and arrays included), via orjson."""
    opts = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    return orjson.loads(orjson.dumps(value, option=opts, default=str))


def _build(fn: Callable[..., dict[str, Any]]) -> _Tool:
    spec = getattr(fn, "spec", None)
    if not isinstance(spec, ToolSpec):
        raise TypeError(f"tool {fn.__name__}: declare it with @tool(kind=..., needs=...)")
    doc = docstring_parser.parse(inspect.getdoc(fn) or "")
    param_docs = {p.arg_name: p.description for p in doc.params}
    fields: dict[str, Any] = {}
    params = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]  # [0] is session
    for p in params:
        if p.annotation is inspect.Parameter.empty:
            raise TypeError(f"tool {fn.__name__}: parameter {p.name!r} needs a type hint")
        default = ... if p.default is inspect.Parameter.empty else p.default
        info = (
            default
            if isinstance(default, FieldInfo)
            else FieldInfo.from_annotated_attribute(p.annotation, default)
        )
        if info.description is None and param_docs.get(p.name):
            info.description = " ".join(
                param_docs[p.name].split()
            )  # docstring wraps are not content
        fields[p.name] = (info.annotation, info)
    model = create_model(f"{fn.__name__}_args", __config__=ConfigDict(extra="forbid"), **fields)
    description = "\n\n".join(x for x in (doc.short_description, doc.long_description) if x)
    schema = {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": description,
            "parameters": _strip_titles(model.model_json_schema()),
        },
    }
    return _Tool(fn, model, schema, spec)


def _explain(err: ValidationError, tool: str) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "arguments"
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown parameter {where!r}")
        elif e["type"] == "missing":
            parts.append(f"missing required parameter {where!r}")
        else:
            parts.append(f"{where}={e.get('input')!r}: {e['msg']}")
    return f"invalid arguments for {tool}: " + "; ".join(parts)


class ToolRegistry:
    """Schemas for the model and validated, never-raising calls for the loop."""

    def __init__(self, tools: Iterable[Callable[..., dict[str, Any]]]):
        self._tools = {fn.__name__: _build(fn) for fn in tools}

    def spec(self, name: str) -> ToolSpec:
        return self._tools[name].spec

    def specs(self) -> dict[str, ToolSpec]:
        return {name: t.spec for name, t in self._tools.items()}

    def defaults(self) -> dict[str, dict[str, Any]]:
        """Per tool, the parameters that have defaults and their values, as JSON values (as the
        record holds parameters: tuples are lists)."""
        return {
            name: {
                k: jsonable(f.default)
                for k, f in t.model.model_fields.items()
                if not f.is_required()
            }
            for name, t in self._tools.items()
        }

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self._tools.values()]

    def validate(self, name: str, arguments: str | dict[str, Any] | None) -> dict[str, Any]:
        """The exact parameters the tool will run with (defaults filled), or ToolError."""
        tool = self._tools.get(name)
        if tool is None:
            raise ToolError(f"unknown tool {name!r}; available tools: {', '.join(self._tools)}")
        if isinstance(arguments, str | bytes):
            try:
                arguments = orjson.loads(arguments) if arguments.strip() else {}
            except orjson.JSONDecodeError as e:
                raise ToolError(
                    f"arguments for {name} are not valid JSON ({e}): {arguments!r:.200}"
                ) from None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise ToolError(f"arguments for {name} must be a JSON object, got {arguments!r:.200}")
        try:
            return tool.model.model_validate(arguments).model_dump(mode="json")
        except ValidationError as e:
            raise ToolError(_explain(e, name)) from None

    def call(self, name: str, arguments: str | dict[str, Any] | None, session: Any) -> Outcome:
        start = time.perf_counter()
        params: dict[str, Any] = {}
        rejected: Any = None
        try:
            try:
                params = self.validate(name, arguments)
            except ToolError:
                rejected = arguments
                raise
            result = jsonable(self._tools[name].fn(session, **params))
            status, error = "ok", None
        except Exception as e:
            # a stop pending: whatever the tool raised is its doing (numba turns the handler's
            # Interrupted into a SystemError), so the call ends the run and is not recorded
            signals.check()
            fault = infrastructure_fault(e)
            if fault is not None:
                raise InfrastructureError(f"{name}: {type(fault).__name__}: {fault}") from e
            if isinstance(e, Refusal):  # the record keeps the check that refused the call
                result, status, error = jsonable({"checks": [e.check]}), "error", str(e)
            elif isinstance(e, ToolError):
                result, status, error = None, "error", str(e)
            else:  # a tool bug must not end the run; the model and record see it
                result, status, error = None, "error", f"{name} failed: {type(e).__name__}: {e}"
        return Outcome(name, params, status, result, error, time.perf_counter() - start, rejected)

"""The tool registry: typed Python functions in, JSON schemas and safe calls out.

A tool is a plain function whose first parameter is the run's session and whose other
parameters are keyword arguments with type hints (ranges via ``Annotated[float, Field(ge=..)]``,
choices via ``Literal``). Its docstring's first paragraph describes it to the model; parameter
descriptions come from ``Field(description=...)`` or from the docstring's Args/Parameters
section. A call never raises: every failure becomes an error ``Outcome`` that the model reads.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import docstring_parser
import orjson
from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic.fields import FieldInfo


class ToolError(Exception):
    """A failure the model should read and can act on (wrong order, bad input, bad value)."""


@dataclass
class Outcome:
    tool: str
    params: dict[str, Any]
    status: Literal["ok", "error"]
    result: dict[str, Any] | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def for_model(self) -> dict[str, Any]:
        """What goes back to the model as the tool message."""
        if self.ok:
            return self.result or {}
        return {"error": self.error}


@dataclass
class _Tool:
    fn: Callable[..., dict[str, Any]]
    model: type[BaseModel]
    schema: dict[str, Any]


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
    return _Tool(fn, model, schema)


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

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def defaults(self) -> dict[str, dict[str, Any]]:
        """Per tool, the parameters that have defaults and their values."""
        return {
            name: {k: f.default for k, f in t.model.model_fields.items() if not f.is_required()}
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
        params: dict[str, Any] = {"_raw": arguments}  # replaced by the validated parameters
        try:
            params = self.validate(name, arguments)
            result = jsonable(self._tools[name].fn(session, **params))
            status, error = "ok", None
        except ToolError as e:
            result, status, error = None, "error", str(e)
        except Exception as e:  # a tool bug must not end the run; the model and record see it
            result, status, error = None, "error", f"{name} failed: {type(e).__name__}: {e}"
        return Outcome(name, params, status, result, error, time.perf_counter() - start)

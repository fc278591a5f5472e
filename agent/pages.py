"""What every HTML page the project writes shares: the Jinja templates and the files inlined
beside them (agent/report/templates/: style sheet, script), and a value as a table cell shows it.
The report (agent/report/html.py), `agent compare`'s page and `agent eval`'s render through it;
it imports none of them, so the cohort commands need not stand on the report.
"""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

import jinja2
import orjson

TEMPLATES = resources.files("agent").joinpath("report", "templates")


def fmt(value: Any) -> str:
    """A cell as people read it: no 'nan', floats to 4 significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return orjson.dumps(value).decode()
    return str(value)


def templates() -> jinja2.Environment:
    """The Jinja templates of every page (agent/report/templates/)."""
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: TEMPLATES.joinpath(name).read_text()),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def asset(name: str) -> str:
    """A file beside the templates (style.css, index.js), inlined into self-contained pages."""
    return TEMPLATES.joinpath(name).read_text()

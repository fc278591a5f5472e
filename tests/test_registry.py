import errno
from typing import Annotated, Literal

import pytest
from pydantic import Field

from agent.registry import InfrastructureError, ToolError, ToolRegistry, tool


class Toy(dict):
    """A session: what has been done so far, as keys, plus the done set every tool updates."""

    def __init__(self, **done: bool):
        super().__init__(**done)
        self.done: set[str] = set()


@tool("cluster", expensive=True)
def leiden(
    session: dict,
    resolution: Annotated[float, Field(ge=0.01, le=5.0, description="Leiden resolution")] = 1.0,
    flavor: Literal["igraph", "leidenalg"] = "igraph",
    n_iterations: int = 2,
) -> dict:
    """Cluster the neighbour graph.

    Args:
        n_iterations: passes of the algorithm
    """
    if "neighbors" not in session:
        raise ToolError("leiden needs the neighbour graph: call neighbors first")
    return {"resolution": resolution, "n_iterations": n_iterations}


@tool("qc")
def crash(session: dict) -> dict:
    """A tool with a bug."""
    return {"x": 1 / 0}


@pytest.fixture
def reg() -> ToolRegistry:
    return ToolRegistry([leiden, crash])


def test_schema_from_signature_and_docstring(reg):
    fn = reg.schemas()[0]["function"]
    assert fn["name"] == "leiden"
    assert fn["description"] == "Cluster the neighbour graph."
    props = fn["parameters"]["properties"]
    assert props["resolution"] == {
        "default": 1.0,
        "description": "Leiden resolution",
        "maximum": 5.0,
        "minimum": 0.01,
        "type": "number",
    }
    assert props["flavor"]["enum"] == ["igraph", "leidenalg"]
    assert props["n_iterations"]["description"] == "passes of the algorithm"
    assert fn["parameters"]["additionalProperties"] is False
    assert reg.defaults()["leiden"] == {"resolution": 1.0, "flavor": "igraph", "n_iterations": 2}


def test_valid_call_records_exact_params_with_defaults(reg):
    out = reg.call("leiden", '{"resolution": 0.5}', Toy(neighbors=True))
    assert out.ok and out.result == {"resolution": 0.5, "n_iterations": 2}
    assert out.params == {"resolution": 0.5, "flavor": "igraph", "n_iterations": 2}


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        (
            "leiden",
            '{"resolution": -1}',
            "resolution=-1: Input should be greater than or equal to 0.01",
        ),
        ("leiden", '{"resolution": "high"}', "resolution='high'"),
        ("leiden", '{"flavor": "louvain"}', "flavor='louvain'"),
        ("leiden", '{"colour": 1}', "unknown parameter 'colour'"),
        ("leiden", "[]", "must be a JSON object"),
        ("leiden", '{"resolution": 0.5', "not valid JSON"),
        ("umap", "{}", "unknown tool 'umap'; available tools: leiden, crash"),
        ("crash", "{}", "crash failed: ZeroDivisionError"),
    ],
)
def test_every_failure_is_an_error_outcome(reg, name, args, message):
    out = reg.call(name, args, Toy(neighbors=True))
    assert out.status == "error" and out.result is None
    assert message in out.error
    assert out.for_model() == {"error": out.error}


def test_tool_error_reaches_the_model(reg):
    out = reg.call("leiden", "{}", Toy())
    assert out.error == "leiden needs the neighbour graph: call neighbors first"


def test_untyped_tool_is_refused_at_registration():
    @tool("qc")
    def bad(session, x):  # no type hint: the model could not be told what x is
        return {}

    with pytest.raises(TypeError, match="parameter 'x' needs a type hint"):
        ToolRegistry([bad])


def test_no_tool_runs_model_written_code():
    """A call's arguments are data checked against typed parameters, never code: no tool module
    evaluates text, starts processes or unpickles (h5ad reading does not unpickle)."""
    import ast
    from pathlib import Path

    import agent.tools

    forbidden_calls = {"eval", "exec", "compile", "__import__", "import_module", "system", "popen"}
    forbidden_modules = {"subprocess", "pickle", "marshal", "shelve", "runpy", "dill", "joblib"}
    found = []
    for path in Path(agent.tools.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                regex = isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "re"
                if name in forbidden_calls and not regex:  # re.compile builds a regex, runs nothing
                    found.append(f"{path.name}:{node.lineno} {name}()")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                found += [
                    f"{path.name}:{node.lineno} import {n}"
                    for n in names
                    if n.split(".")[0] in forbidden_modules
                ]
    assert not found, found


def test_a_function_without_tool_metadata_is_refused():
    def bare(session: dict) -> dict:
        """No @tool."""
        return {}

    with pytest.raises(TypeError, match=r"bare: declare it with @tool"):
        ToolRegistry([bare])


def test_every_agent_tool_declares_its_metadata():
    """Kind, prerequisites, cost and whether it changes the data: declared once, next to the
    tool; every prerequisite is itself a tool, for every kind of plot."""
    from typing import get_args

    from agent.registry import Kind, ToolSpec
    from agent.tools import TOOLS, build_registry

    registry = build_registry()
    specs = registry.specs()
    assert list(specs) == [fn.__name__ for fn in TOOLS]
    kinds = set(get_args(Kind))
    plot_kinds = get_args(registry._tools["plot"].model.model_fields["kind"].annotation)
    for name, spec in specs.items():
        assert isinstance(spec, ToolSpec) and spec.kind in kinds, name
        for params in [{}] + [{"kind": k} for k in plot_kinds]:
            assert set(spec.needs_for(params)) <= set(specs), (name, params)
    assert {n for n, s in specs.items() if not s.mutates} == {"plot", "save", "finish"}


def test_prerequisites_are_checked_and_success_is_marked_whoever_calls():
    @tool("embed", needs=("pca",))
    def neighbors(session: dict) -> dict:
        """Needs pca."""
        return {}

    class Session(Toy):
        def require(self, tool: str, *steps: str) -> None:
            missing = [s for s in steps if s not in self.done]
            if missing:
                raise ToolError(f"{tool} needs {missing[0]} first")

    session = Session()
    with pytest.raises(ToolError, match="neighbors needs pca first"):
        neighbors(session)  # called directly, not through the registry
    session.done.add("pca")
    neighbors(session)
    assert session.done == {"pca", "neighbors"}


def test_a_fault_of_the_machine_is_raised_not_recorded_as_the_calls_result():
    """EIO, a full disk or exhausted memory are no result of the analysis (a retry resumes); a
    missing file named by the model is the call's own mistake, recorded for the model to read."""

    @tool("load", mutates=False)
    def read_it(session: object, what: str = "eio") -> dict:
        """Read something."""
        try:
            if what == "eio":
                raise OSError(errno.EIO, "Input/output error", "/data/x.h5ad")
            if what == "memory":
                raise MemoryError()
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.h5ad")
        except OSError as e:  # as tools do: a readable message, the cause kept as context
            raise ToolError(f"could not read /data/x.h5ad: {e}") from None

    registry = ToolRegistry([read_it])
    with pytest.raises(InfrastructureError, match=r"read_it: OSError: \[Errno 5\]"):
        registry.call("read_it", {"what": "eio"}, object())
    with pytest.raises(InfrastructureError, match="MemoryError"):
        registry.call("read_it", {"what": "memory"}, object())
    missing = registry.call("read_it", {"what": "enoent"}, object())
    assert missing.status == "error" and "No such file" in missing.error

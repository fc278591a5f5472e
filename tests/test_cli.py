"""`python -m agent` manners: --version, defaults in --help, one line and an exit status for an
expected failure, fast answers to a missing path, the failed step's reason and the closing line."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from agent.cli import main as cli

AGENT = [sys.executable, "-m", "agent"]


def test_version_is_the_package_version_at_top_level_and_per_subcommand():
    for args in (["--version"], ["run", "--version"]):
        out = subprocess.run([*AGENT, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"scagent {metadata.version('scagent')}"


@pytest.mark.parametrize(
    "command, shown",
    [
        ("run", ["(default: 120)", "(default: reference)", "(default: the input's name;"]),
        ("replay", ["(default: 1e-06)", "(default: beside the world state)"]),
    ],
)
def test_help_shows_each_default_once(command, shown, capsys):
    with pytest.raises(SystemExit) as done:
        cli([command, "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in shown:
        assert text.count(default) == 1, (default, text)
    assert "(default: None)" not in text and "(default: False)" not in text


def test_run_help_documents_every_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for status in ("0 the analysis ended", "1 something outside", "2 refused before starting"):
        assert status in text, text
    assert "3 the input was refused" in text and "128+N stopped by signal N" in text


def _stays_light(argv: list[str]) -> tuple[int, str, float]:
    """Exit status, stderr and seconds of `cli.main(argv)` in a fresh interpreter, which fails
    if it imported scanpy, anndata or vllm on the way."""
    check = (
        "import sys; from agent.cli import main; rc = main(sys.argv[1:]); "
        "heavy = {'scanpy', 'anndata', 'vllm'} & set(sys.modules); "
        "assert not heavy, heavy; sys.exit(rc)"
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", check, *argv], capture_output=True, text=True, timeout=60
    )
    return out.returncode, out.stderr, time.monotonic() - t0


def test_a_missing_path_is_answered_at_once_in_one_line(tmp_path):
    gone = tmp_path / "gone"
    cases = [
        (["run", "--input", str(gone), "--outdir", str(tmp_path / "out")], "does not exist"),
        (["replay", "--world-state", str(gone / "world_state.json")], "is not a file"),
        (
            ["report", "--world-states", str(gone), "--outdir", str(tmp_path / "r"),
             "--truth-dir", str(gone)],
            "--truth-dir",
        ),
    ]  # fmt: skip
    for argv, text in cases:
        code, stderr, seconds = _stays_light(argv)
        assert code == 2 and text in stderr, (argv, stderr)
        assert len(stderr.strip().splitlines()) == 1, stderr
        assert seconds < 2, (argv, seconds)
    assert not gone.exists() and not (tmp_path / "out").exists() and not (tmp_path / "r").exists()


def test_an_unreachable_server_ends_in_one_line_and_exit_1(small_input, tmp_path):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [*AGENT, "run", "--input", str(small_input), "--outdir", str(tmp_path), "--sample", "s",
         "--policy", "llm", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "x",
         "--server-wait", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("[s] failed (exit 1): 0 steps in "), line
    assert f"record {tmp_path / 'world_state.json'}; " in line and "not ready after 1 s" in line


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    # a subprocess: the loop's log stream is the stderr of the process, which capsys replaces
    return subprocess.run([*AGENT, *args], capture_output=True, text=True, timeout=300)


def test_a_run_closes_with_how_it_ended_its_steps_and_its_record(small_input, tmp_path):
    argv = ["run", "--input", str(small_input), "--outdir", str(tmp_path), "--sample", "s"]
    out = _agent(*argv, "--max-steps", "2")
    assert out.returncode == 0, out.stderr
    last = out.stderr.splitlines()[-1]
    assert last.startswith("[s] analysis ended without finish (step_limit): 2 steps in "), last
    assert last.endswith(f" s; record {tmp_path / 'world_state.json'}"), last
    kept = _agent(*argv, "--max-steps", "2")
    assert kept.returncode == 0, kept.stderr
    assert "kept the analysis" in kept.stderr, kept.stderr
    assert ": 2 steps in " in kept.stderr.splitlines()[-1], kept.stderr


def test_a_failed_step_shows_its_reason(tmp_path):
    folder = tmp_path / "no_matrix"
    folder.mkdir()
    out = _agent(
        "run", "--input", str(folder), "--outdir", str(tmp_path / "out"), "--max-steps", "1"
    )
    assert out.returncode == 0, out.stderr  # the step limit came before the input was refused
    [step] = [line for line in out.stderr.splitlines() if line.startswith("[no_matrix] step 1 ")]
    assert step.startswith("[no_matrix] step 1 load_data! "), step
    assert f": {folder} is a folder without matrix.mtx" in step, step


def test_plan_takes_a_model_as_serve_does(tmp_path, monkeypatch, capsys):
    """`agent plan --model`: a folder, or a Hub id found offline in the Hugging Face cache, planned
    exactly as its config.json; a Hub id not in the cache is one line saying how to fetch it."""
    config = Path(__file__).parent / "data" / "model_configs" / "qwen3-8b.json"
    cache = tmp_path / "hub"
    snapshot = cache / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copy(config, snapshot / "config.json")
    (cache / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (cache / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    outputs = []
    for model in (["--model-config", str(config)], ["--model", "Qwen/Qwen3-8B"],
                  ["--model", str(snapshot)]):  # fmt: skip
        assert cli(["plan", *model, "--gpu", "H100", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        outputs.append({k: v for k, v in plan.items() if k != "model"})  # the config's path
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0]["max_model_len"] > 0
    assert cli(["plan", "--model", "Qwen/Qwen3-32B", "--gpu", "H100"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "not in the Hugging Face cache" in line and "hf download Qwen/Qwen3-32B" in line
    assert cli(["plan", "--gpu", "H100"]) == 2
    assert "give one of --model" in capsys.readouterr().err

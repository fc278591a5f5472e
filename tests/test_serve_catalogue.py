"""The model catalogue: its names against vLLM's own registries, family matching, site files."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jinja2.sandbox import ImmutableSandboxedEnvironment

from agent.serve import catalogue
from agent.serve.catalogue import CatalogueError
from agent.serve.model_config import load_model_config

CONFIGS = Path(__file__).parent / "data" / "model_configs"
FETCH_MODEL = Path(__file__).parents[1] / "workflow" / "scripts" / "fetch_model.py"
CONTRACT_KEYS = {
    "name",
    "tool_call_parser",
    "reasoning_parser",
    "sampling",
    "max_tokens",
    "thinking",
    "no_thinking",
}


def config(name: str) -> dict:
    return load_model_config(CONFIGS / f"{name}.json")


@pytest.mark.parametrize(
    ("file", "family", "tool_parser", "reasoning"),
    [
        ("qwen3-8b", "qwen3", "hermes", "qwen3"),
        ("qwen2.5-7b", "qwen2", "hermes", None),
        ("qwen3-next-80b-a3b-instruct", "qwen3-next", "hermes", None),  # Instruct: no thinking
        ("qwen3.6-27b", "qwen3.5", "qwen3_coder", "qwen3"),  # text_config: qwen3_5_text
        ("gemma-3-12b-it", "gemma3", "pythonic", None),
        ("gemma-4-31b-it", "gemma4", "gemma4", "gemma4"),  # text_config: gemma4_text
        ("llama-3.1-8b-instruct", "llama3", "llama3_json", None),
        ("deepseek-v3", "deepseek_v3", "deepseek_v3", None),
    ],
)
def test_published_configs_find_their_family(file, family, tool_parser, reasoning):
    found = catalogue.family_for(config(file))
    assert (found.name, found.tool_call_parser, found.reasoning_parser) == (
        family,
        tool_parser,
        reasoning,
    )


def test_architectures_match_when_the_model_type_does_not():
    llama_like = {"model_type": "my_llama_variant", "architectures": ["LlamaForCausalLM"]}
    assert catalogue.family_for(llama_like).name == "llama3"
    with pytest.raises(CatalogueError, match=r"matches model_type mystery.*known families"):
        catalogue.family_for({"model_type": "mystery", "architectures": ["M"]})


def test_a_name_forces_a_family():
    assert catalogue.family_for(config("qwen3-8b"), "gemma3").name == "gemma3"
    with pytest.raises(CatalogueError, match="'gemma9' is not in the catalogue"):
        catalogue.family_for(config("qwen3-8b"), "gemma9")


def test_thinking_families_get_room_to_think_and_a_switch():
    cat = catalogue.load()
    for name in ("qwen3", "qwen3.5"):
        family = cat.get(name)
        assert family.thinking and family.max_tokens >= 8192
        assert family.no_thinking == {"chat_template_kwargs": {"enable_thinking": False}}
        assert family.sampling["temperature"] > 0  # Qwen warns against greedy decoding
    assert cat.get("qwen3.5").speculative == {"method": "mtp", "num_speculative_tokens": 2}
    assert not cat.get("llama3").thinking and cat.get("llama3").reasoning_parser is None


def test_to_dict_is_json_and_carries_the_contract_keys():
    d = catalogue.load().get("qwen3.5").to_dict()
    assert set(d) >= CONTRACT_KEYS and json.loads(json.dumps(d)) == d
    assert d["model_types"][0] == "qwen3_5" and d["sampling"]["top_k"] == 20


def test_gemma3_tool_template_ships_and_renders_tools(tmp_path):
    family = catalogue.load().get("gemma3")
    path = family.chat_template_path()
    assert path.is_file() and path.parent == catalogue.TEMPLATES

    def fail(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = fail
    tools = [{"type": "function", "function": {"name": "load_data", "parameters": {}}}]
    prompt = env.from_string(path.read_text()).render(
        messages=[{"role": "system", "content": "Analyse."}, {"role": "user", "content": "Go"}],
        tools=tools,
        bos_token="<bos>",
        add_generation_prompt=True,
    )
    assert "python list of the function calls" in prompt and '"load_data"' in prompt
    assert prompt.endswith("<start_of_turn>model\n")


@pytest.mark.parametrize(
    ("family", "call_format"),
    [
        ("llama3", '"name": function name, "parameters"'),
        ("deepseek_v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>"),
    ],
)
def test_the_tool_templates_vllm_names_ship_and_render_tools(family, call_format):
    path = catalogue.load().get(family).chat_template_path()
    assert path.is_file() and path.parent == catalogue.TEMPLATES
    tools = [{"type": "function", "function": {"name": "load_data", "parameters": {}}}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(path.read_text()).render(
        messages=[{"role": "system", "content": "Analyse."}, {"role": "user", "content": "Go"}],
        tools=tools,
        bos_token="<bos>",
        add_generation_prompt=True,
    )
    assert '"load_data"' in prompt and call_format in prompt


def test_thinking_families_get_their_current_turns_thoughts_back():
    """A family whose template renders earlier thoughts (a reasoning parser) gets those of the
    current turn back; the others none; the FP8 checkpoint and drafter maps load as written."""
    cat = catalogue.load()
    for family in cat.families.values():
        expected = "current_turn" if family.reasoning_parser else "none"
        assert family.history_reasoning == expected, family.name
    assert cat.get("qwen3.5").fp8_checkpoints["Qwen/Qwen3.6-27B"] == "Qwen/Qwen3.6-27B-FP8"
    assert cat.get("gemma4").drafters["google/gemma-4-31B-it"].endswith("-assistant")
    # fetch_model fetches them beside the model
    spec = importlib.util.spec_from_file_location("fetch_model", FETCH_MODEL)
    fetch_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_model)
    assert fetch_model.companions("Qwen/Qwen3.6-27B") == ["Qwen/Qwen3.6-27B-FP8"]
    assert fetch_model.companions("google/gemma-4-E2B-it") == ["google/gemma-4-E2B-it-assistant"]
    assert fetch_model.companions("Qwen/Qwen3-8B") == []


def test_site_file_overrides_fields_and_adds_families(tmp_path, monkeypatch):
    site = tmp_path / "site.yaml"
    site.write_text(
        yaml.safe_dump(
            {
                "qwen3": {"sampling": {"temperature": 0.7}, "max_tokens": 4096},
                "mymodel": {
                    **{
                        k: v
                        for k, v in yaml.safe_load(catalogue.PACKAGED.read_text())["llama3"].items()
                    },
                    "match": {"model_types": ["mymodel"]},
                },
            }
        )
    )
    monkeypatch.setenv(catalogue.SITE_ENV, str(site))
    cat = catalogue.load()
    qwen3 = cat.get("qwen3")
    assert qwen3.sampling == {"temperature": 0.7} and qwen3.max_tokens == 4096
    assert qwen3.tool_call_parser == "hermes"  # fields the site left alone stay
    assert str(site) in qwen3.source
    assert cat.family_for({"model_type": "mymodel"}).name == "mymodel"
    # --catalogue comes after $SCAGENT_MODELS
    later = tmp_path / "later.yaml"
    later.write_text(yaml.safe_dump({"qwen3": {"max_tokens": 2048}}))
    assert catalogue.load(later).get("qwen3").max_tokens == 2048


def test_bad_site_files_name_the_file_family_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"qwen3": {"max_tokens": "lots"}}))
    with pytest.raises(CatalogueError, match=r"bad.yaml: family 'qwen3': max_tokens"):
        catalogue.load(bad)
    bad.write_text(yaml.safe_dump({"newfam": {"tool_call_parser": "hermes"}}))
    with pytest.raises(CatalogueError, match=r"family 'newfam': match: Field required"):
        catalogue.load(bad)
    bad.write_text(yaml.safe_dump({"qwen3": {"history_reasoning": "sometimes"}}))
    with pytest.raises(CatalogueError, match=r"history_reasoning: Input should be 'none'"):
        catalogue.load(bad)
    bad.write_text(yaml.safe_dump({"gemma3": {"chat_template": "nowhere.jinja"}}))
    with pytest.raises(CatalogueError, match=r"chat_template .*nowhere.jinja: no such file"):
        catalogue.load(bad)
    bad.write_text("- a list\n")
    with pytest.raises(CatalogueError, match="expected a mapping of family name"):
        catalogue.load(bad)
    with pytest.raises(CatalogueError, match=r"missing\.yaml: No such file"):
        catalogue.load(tmp_path / "missing.yaml")


_REGISTRIES = """
import json, sys, typing
from vllm.config.speculative import SpeculativeMethod
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

def names(t):
    return {a for x in typing.get_args(t) for a in (names(x) if typing.get_args(x) else [x])}

tools = {}
for name in json.loads(sys.argv[1]):
    if name in ToolParserManager.list_registered():
        tools[name] = ToolParserManager.get_tool_parser(name).structural_tag_model is not None
print(json.dumps({
    "tools": tools,
    "reasoning": ReasoningParserManager.list_registered(),
    "speculative": sorted(names(SpeculativeMethod)),
}))
"""


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_every_name_is_in_vllms_own_registries():
    """An upgrade of vLLM that renames a parser or a speculative method fails here."""
    families = catalogue.load().families.values()
    tool_names = sorted({f.tool_call_parser for f in families})
    done = subprocess.run(
        [sys.executable, "-c", _REGISTRIES, json.dumps(tool_names)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for family in families:
        assert family.tool_call_parser in found["tools"], (family.name, family.tool_call_parser)
        # strict_tools says whether --tool-strict-level can constrain this parser's calls
        assert found["tools"][family.tool_call_parser] == family.strict_tools, family.name
        if family.reasoning_parser:
            assert family.reasoning_parser in found["reasoning"], family.name
        if family.speculative:
            assert family.speculative["method"] in found["speculative"], family.name

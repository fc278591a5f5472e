"""A tiny random-weight Qwen3-style chat model, built locally (no downloads) for a real vLLM.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on a seeded synthetic corpus, so any
prompt encodes; the chat template renders tools and Hermes-style ``<tool_call>`` blocks the way
Qwen2.5/Qwen3 templates do, so vLLM's ``hermes`` tool parser reads what the model writes.
The weights are random: the model's text is noise, but its token counts, prompt caching and
context-length limits are the server's real ones.

``python -m agent.testing.tiny_model OUTDIR`` builds it by hand.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 0
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

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


CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls | default([]) %}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def build_tokenizer(outdir: Path, vocab_size: int = 2048) -> int:
    """Train a byte-level BPE on the corpus; write tokenizer.json and its config. Returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(outdir / "tokenizer.json"))
    (outdir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 32768,
                "chat_template": CHAT_TEMPLATE,
                "added_tokens_decoder": {
                    str(tok.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL_TOKENS
                },
            },
            indent=1,
        )
    )
    return tok.get_vocab_size()


def build_tiny_model(outdir: str | Path, seed: int = SEED) -> Path:
    """Write a loadable Qwen3ForCausalLM checkpoint (hidden 64, 2 layers) with its tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    ids = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    special = {t["content"]: t["id"] for t in ids}
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention supports 32, 64, 80, ... (not 16)
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": special["<|im_end|>"], "pad_token_id": special["<|endoftext|>"]}
        )
    )
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m agent.testing.tiny_model OUTDIR")
    print(build_tiny_model(sys.argv[1]))

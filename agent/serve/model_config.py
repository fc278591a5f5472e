"""The shape of a model, read from its Hugging Face ``config.json``: what KV planning and flags need.

Published configs leave out fields whose value is the architecture's default (Gemma 3's
``text_config`` names no head count), so a few family defaults are filled in here, the same
values transformers' config classes use. Layers are classified as full attention, sliding-window
attention, linear attention (a fixed-size recurrent state per sequence) or KV-shared (Gemma 4's
last ``num_kv_shared_layers`` read an earlier layer's cache and hold none), because only full
attention layers grow their KV cache with every token. Full-attention layers may have their own KV
head count and head dim (Gemma 4's global layers: ``num_global_key_value_heads`` x
``global_head_dim``). Multimodal checkpoints keep the text model under ``text_config``
(``qwen3_5_text``, ``gemma4_text``); the vision tower's size is estimated from ``vision_config``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

LayerKind = Literal["full", "sliding", "linear", "shared"]

# transformers' defaults for fields that published configs of these families omit.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "vocab_size": 262_208,
        "max_position_embeddings": 131_072,
        "tie_word_embeddings": True,
    },
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "tie_word_embeddings": True},
    "gemma3n_text": {"head_dim": 256},
}
# Gemma 4's global (full-attention) layers: transformers' Gemma4TextConfig pops global_head_dim
# with default 512 and, where attention_k_eq_v is set, uses num_global_key_value_heads.
_GLOBAL_HEAD_DIM_DEFAULT = {"gemma4_text": 512}
# Vision towers whose MLP is gated (three matrices, as Gemma 4's); others have two (SigLIP, Qwen).
_GATED_VISION = {"gemma4_vision"}
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class ModelConfigError(ValueError):
    """A config.json that cannot be read as a decoder model, with the file and field named."""


@dataclass(frozen=True)
class LinearAttention:
    """Gated-delta / linear-attention layer sizes (Qwen3-Next style): state per sequence, not per token."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    ssm_fp32: bool = False  # the config asks vLLM for a float32 recurrent state (mamba_ssm_dtype)


@dataclass(frozen=True)
class ModelShape:
    source: str
    model_type: str
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    dtype_bytes: int
    layer_kinds: tuple[LayerKind, ...]
    sliding_window: int | None
    # KV heads and head dim of the full-attention layers where they differ (Gemma 4's global ones)
    full_kv_heads: int | None = None
    full_head_dim: int | None = None
    # Multi-head latent attention (DeepSeek-V2/V3): one compressed latent per token and layer.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    linear: LinearAttention | None = None
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    first_dense_layers: int = 0
    mtp_layers: int = 0
    quant_method: str | None = None
    vision_params: int = 0  # the vision tower's weights, estimated from vision_config
    attn_output_gate: bool = False  # Qwen3.5: q_proj also yields a gate, doubling its outputs
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def family(self) -> str:
        return self.model_type

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def checkpoint_fp8(self) -> bool:
        return self.quant_method == "fp8"

    def count(self, kind: LayerKind) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    def kv_heads(self, kind: LayerKind = "sliding") -> int:
        return (self.full_kv_heads or self.num_kv_heads) if kind == "full" else self.num_kv_heads

    def layer_head_dim(self, kind: LayerKind = "sliding") -> int:
        return (self.full_head_dim or self.head_dim) if kind == "full" else self.head_dim

    def kv_bytes_per_token_per_layer(
        self, kv_bytes: float, kind: LayerKind = "full", tp: int = 1
    ) -> float:
        """KV cache bytes one token takes in one ``kind`` layer, summed over ``tp`` GPUs.

        Tensor parallelism splits KV heads over the GPUs, but a GPU holds at least one: with more
        GPUs than KV heads each head is replicated. An MLA latent is not split at all.
        """
        if self.is_mla:
            return (self.kv_lora_rank + (self.qk_rope_head_dim or 0)) * kv_bytes * tp
        heads = max(self.kv_heads(kind), tp)
        return 2 * heads * self.layer_head_dim(kind) * kv_bytes

    def kv_bytes_per_token(
        self, kv_bytes: float, tp: int = 1, sliding_kv_bytes: float | None = None
    ) -> float:
        """Bytes per token over all attention layers (sliding ones too, within their window);
        ``sliding_kv_bytes``: the sliding layers' own dtype where the KV cache skips them."""
        sliding = kv_bytes if sliding_kv_bytes is None else sliding_kv_bytes
        return self.count("full") * self.kv_bytes_per_token_per_layer(
            kv_bytes, "full", tp
        ) + self.count("sliding") * self.kv_bytes_per_token_per_layer(sliding, "sliding", tp)

    def linear_layer_state_bytes(self, draft_tokens: int = 0, on_cpu: bool = False) -> float:
        """One linear-attention layer's recurrent + conv state for one sequence; the conv window
        holds the drafted tokens too. vLLM keeps the recurrent state in the config's
        ``mamba_ssm_dtype`` (Qwen3.5/3.6: float32), else in the model's dtype on a GPU; vLLM-CPU
        keeps it in float32."""
        lin = self.linear
        if lin is None:
            return 0.0
        ssm_bytes = 4 if lin.ssm_fp32 or on_cpu else self.dtype_bytes
        ssm = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim * ssm_bytes
        conv_dim = (
            2 * lin.num_key_heads * lin.key_head_dim + lin.num_value_heads * lin.value_head_dim
        )
        return ssm + (lin.conv_kernel - 1 + draft_tokens) * conv_dim * self.dtype_bytes

    def linear_state_bytes(self, draft_tokens: int = 0, on_cpu: bool = False) -> float:
        """Fixed recurrent + conv state per sequence over all linear-attention layers."""
        return self.count("linear") * self.linear_layer_state_bytes(draft_tokens, on_cpu)

    def sliding_tokens(self, tokens: int, in_flight: int | None = 0) -> int:
        """Tokens a sliding-window layer holds for a sequence of ``tokens``: its window, plus the
        tokens of the steps in flight (vLLM frees blocks behind the window only once a step is
        done, and reserves ``window - 1 + in-flight`` per request); ``in_flight`` None: the whole
        prompt is computed in one step (vLLM-CPU here), so the layer holds all of it at once."""
        if not self.sliding_window or in_flight is None:
            return tokens
        return min(
            tokens, self.sliding_window - 1 + in_flight if in_flight else self.sliding_window
        )

    def sequence_bytes(
        self,
        tokens: int,
        kv_bytes: float,
        tp: int = 1,
        *,
        in_flight: int | None = 0,
        linear_states: int = 1,
        mtp_layers: int = 0,
        sliding_kv_bytes: float | None = None,
        draft_tokens: int = 0,
        on_cpu: bool = False,
    ) -> float:
        """Cache bytes one sequence of ``tokens`` tokens holds: sliding layers up to their window
        (``sliding_tokens``), ``linear_states`` copies of the linear-attention state (vLLM keeps
        several with prefix caching and speculative decoding), and ``mtp_layers`` MTP layers that
        keep full-attention KV when they draft; ``sliding_kv_bytes`` as in ``kv_bytes_per_token``;
        ``draft_tokens`` widen each linear state's conv window; a hybrid takes vLLM's pages
        (``hybrid_layout``), which differ on the CPU (``on_cpu``). No model mixes linear and
        sliding layers, so a hybrid's layers are linear and full."""
        if self.linear is not None and self.count("full") + mtp_layers:
            block, full, linear = self.hybrid_layout(kv_bytes, tp, mtp_layers, draft_tokens, on_cpu)
            page = block * self.kv_bytes_per_token_per_layer(kv_bytes, "full", tp)
            return page * (full * math.ceil(tokens / block) + linear * linear_states)
        full = (self.count("full") + mtp_layers) * self.kv_bytes_per_token_per_layer(
            kv_bytes, "full", tp
        )
        sliding = self.count("sliding") * self.kv_bytes_per_token_per_layer(
            kv_bytes if sliding_kv_bytes is None else sliding_kv_bytes, "sliding", tp
        )
        return (
            full * tokens
            + sliding * self.sliding_tokens(tokens, in_flight)
            + linear_states * self.linear_state_bytes(draft_tokens, on_cpu)
        )

    def hybrid_layout(
        self, kv_bytes: float, tp: int, mtp_layers: int, draft_tokens: int, on_cpu: bool
    ) -> tuple[int, int, int]:
        """A linear + full attention model's cache as vLLM 0.32 lays it out: (tokens of an
        attention block, full and linear layers counted with their padding). One page size for
        both kinds: the block grows from the platform's (16 tokens on a GPU, 128 on the CPU) in
        steps of it until its page holds one layer's linear state, which is padded to the page.
        Layers go by kind into groups of one size (the smaller kind's count, or the larger's when
        within 1.5x), the last group of a kind filled up with unused layers."""
        step = 128 if on_cpu else 16
        per_token = self.kv_bytes_per_token_per_layer(kv_bytes, "full", tp)
        state = self.linear_layer_state_bytes(draft_tokens, on_cpu)
        block = step * math.ceil(state / (step * per_token))
        counts = (self.count("full") + mtp_layers, self.count("linear"))
        size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
        full, linear = (math.ceil(n / size) * size for n in counts)
        return block, full, linear

    def mtp_params(self) -> int:
        """Weights of the declared MTP layers (each a full decoder layer and a 2h -> h projection),
        loaded only when they draft."""
        per_layer = self.param_count_of_layer("full") + 2 * self.hidden_size**2
        return self.mtp_layers * per_layer

    def embedding_params(self) -> int:
        """Input embeddings and lm_head (one matrix when tied): kept in bf16 by FP8 quantization."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def param_count(self) -> int:
        """Weights estimated from the shapes (text model only; norms and biases ignored)."""
        h, layers = self.hidden_size, self.num_layers
        embed = self.embedding_params()
        per_kind = {
            "full": self._attention_params("full"),
            "sliding": self._attention_params(),
            "shared": self._attention_params(),
            "linear": self._linear_params(),
        }
        attn = sum(per_kind[k] for k in self.layer_kinds)
        dense_mlp = 3 * h * self.intermediate_size
        if self.num_experts:
            moe = 3 * h * self.moe_intermediate_size * self.num_experts + h * self.num_experts
            moe += 3 * h * self.shared_expert_intermediate_size
            mlp = self.first_dense_layers * dense_mlp + (layers - self.first_dense_layers) * moe
        else:
            mlp = layers * dense_mlp
        return int(embed + attn + mlp + self.vision_params)

    def param_count_of_layer(self, kind: LayerKind) -> int:
        """One decoder layer of ``kind``: its attention (or linear attention) and its MLP."""
        h = self.hidden_size
        attn = self._linear_params() if kind == "linear" else self._attention_params(kind)
        if self.num_experts:
            mlp = 3 * h * self.moe_intermediate_size * self.num_experts + h * self.num_experts
            mlp += 3 * h * self.shared_expert_intermediate_size
        else:
            mlp = 3 * h * self.intermediate_size
        return attn + mlp

    def _attention_params(self, kind: LayerKind = "sliding") -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
            q = (
                h * self.q_lora_rank + self.q_lora_rank * heads * qk
                if self.q_lora_rank
                else h * heads * qk
            )
            kv = h * (self.kv_lora_rank + (self.qk_rope_head_dim or 0))
            kv += (
                self.kv_lora_rank * heads * ((self.qk_nope_head_dim or 0) + (self.v_head_dim or 0))
            )
            return q + kv + heads * (self.v_head_dim or 0) * h
        head_dim = self.layer_head_dim(kind)
        gate = h * heads * head_dim if self.attn_output_gate and kind == "full" else 0
        return 2 * h * heads * head_dim + gate + 2 * h * self.kv_heads(kind) * head_dim

    def _linear_params(self) -> int:
        lin = self.linear
        if lin is None:
            return 0
        h = self.hidden_size
        key, value = lin.num_key_heads * lin.key_head_dim, lin.num_value_heads * lin.value_head_dim
        return h * (2 * key + 2 * value) + h * 2 * lin.num_value_heads + value * h


def load_model_config(path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` (or ``DIR/config.json``) as a dict, naming the file on any error."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelConfigError(f"model config {p}: no such file (expected a config.json)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"model config {p}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(
            f"model config {p}: expected a JSON object, got {type(data).__name__}"
        )
    data.setdefault("_source", str(p))
    return data


def _int(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ModelConfigError(
            f"model config {source}: field {key!r} is missing (expected an integer)"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(
            f"model config {source}: field {key!r} = {value!r} (expected a non-negative integer)"
        )
    return value


def _layer_kinds(
    cfg: dict[str, Any], n: int, source: str
) -> tuple[tuple[LayerKind, ...], int | None]:
    """Which layers are full, sliding-window or linear attention, and the window size."""
    window = cfg.get("sliding_window")
    names = {
        "full_attention": "full",
        "attention": "full",
        "sliding_attention": "sliding",
        "linear_attention": "linear",
    }
    if isinstance(cfg.get("layer_types"), list):
        types = cfg["layer_types"][:n]
        unknown = sorted({t for t in types if t not in names})
        if unknown or len(types) != n:
            raise ModelConfigError(
                f"model config {source}: layer_types must list {n} of {sorted(names)}; "
                f"got {len(types)} entries, unknown {unknown}"
            )
        kinds = tuple(names[t] for t in types)
        shared = int(cfg.get("num_kv_shared_layers") or 0)  # Gemma 4: the last ones reuse a cache
        if shared:
            kinds = kinds[: n - shared] + ("shared",) * shared
    elif cfg.get("full_attention_interval"):  # Qwen3-Next: every k-th layer is full attention
        k = int(cfg["full_attention_interval"])
        kinds = tuple("full" if (i + 1) % k == 0 else "linear" for i in range(n))
    elif cfg.get("model_type") == "gemma2":  # alternates, sliding first
        kinds = tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
    elif cfg.get("sliding_window_pattern") and window:  # Gemma 3: every k-th layer is global
        k = int(cfg["sliding_window_pattern"])
        kinds = tuple("full" if (i + 1) % k == 0 else "sliding" for i in range(n))
    elif window and cfg.get("use_sliding_window", True):  # Mistral-style: every layer windowed
        kinds = ("sliding",) * n
    else:
        kinds = ("full",) * n
    return kinds, (int(window) if "sliding" in kinds else None)


def _mtp_layers(cfg: dict[str, Any], top: dict[str, Any]) -> int:
    """MTP heads the checkpoint declares (DeepSeek: num_nextn_predict_layers; Qwen3.5: mtp_num_hidden_layers)."""
    for c in (cfg, top):
        for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
            if isinstance(c.get(key), int) and c[key] > 0:
                return c[key]
    return 0


def _vision_params(config: dict[str, Any]) -> int:
    """Vision tower weights from ``vision_config``: layers x (attention 4h^2 + MLP)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    h = vision.get("hidden_size") or 0
    inner = vision.get("intermediate_size") or 4 * h
    layers = vision.get("num_hidden_layers") or vision.get("depth") or 0
    mats = 3 if vision.get("model_type") in _GATED_VISION else 2
    return int(layers * (4 * h * h + mats * h * inner))


def _full_attention(cfg: dict[str, Any]) -> tuple[int | None, int | None]:
    """KV heads and head dim of the full-attention layers, where the family gives them their own:
    ``global_head_dim`` / ``num_global_key_value_heads`` as published, or ``per_layer_config``
    ({layer index: {head_dim, num_key_value_heads}}) as transformers 5 writes Gemma 4's."""
    per_layer = cfg.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:
        first = next(iter(per_layer.values()))
        heads, head_dim = first.get("num_key_value_heads"), first.get("head_dim")
    else:
        head_dim = cfg.get("global_head_dim", _GLOBAL_HEAD_DIM_DEFAULT.get(cfg["model_type"]))
        heads = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    return (int(heads) if heads else None), (int(head_dim) if head_dim else None)


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Parse a config dict (top level, or nested ``text_config`` for multimodal models)."""
    source = str(config.get("_source", "<dict>"))
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    model_type = str((text or config).get("model_type") or config.get("model_type") or "")
    if text is not None and not text.get("model_type") and config.get("model_type") == "gemma3":
        model_type = "gemma3_text"
    cfg = {**_FAMILY_DEFAULTS.get(model_type, {}), **(text or config)}
    cfg["model_type"] = model_type
    n = _int(cfg, "num_hidden_layers", source)
    hidden = _int(cfg, "hidden_size", source)
    heads = _int(cfg, "num_attention_heads", source)
    kv_heads = _int(cfg, "num_key_value_heads", source, default=heads)
    if heads == 0 or n == 0:
        raise ModelConfigError(
            f"model config {source}: num_hidden_layers and num_attention_heads must be > 0"
        )
    head_dim = _int(cfg, "head_dim", source, default=hidden // heads)
    kinds, window = _layer_kinds(cfg, n, source)
    dtype = str(
        cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16"
    )
    quant = config.get("quantization_config") or cfg.get("quantization_config") or {}
    linear = None
    if "linear" in kinds:
        linear = LinearAttention(
            num_key_heads=_int(cfg, "linear_num_key_heads", source),
            num_value_heads=_int(cfg, "linear_num_value_heads", source),
            key_head_dim=_int(cfg, "linear_key_head_dim", source),
            value_head_dim=_int(cfg, "linear_value_head_dim", source),
            conv_kernel=_int(cfg, "linear_conv_kernel_dim", source, default=4),
            ssm_fp32=cfg.get("mamba_ssm_dtype") in ("float32", "fp32"),
        )
    experts = (
        cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    )
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if not shared and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * int(cfg.get("moe_intermediate_size") or 0)
    mla = cfg.get("kv_lora_rank")
    full_kv_heads, full_head_dim = _full_attention(cfg)
    return ModelShape(
        source=source,
        model_type=model_type,
        architectures=tuple(config.get("architectures") or cfg.get("architectures") or ()),
        num_layers=n,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", source),
        intermediate_size=_int(cfg, "intermediate_size", source, default=4 * hidden),
        tie_word_embeddings=bool(
            cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        ),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        layer_kinds=kinds,
        sliding_window=window,
        full_kv_heads=full_kv_heads,
        full_head_dim=full_head_dim,
        kv_lora_rank=int(mla) if mla else None,
        qk_rope_head_dim=cfg.get("qk_rope_head_dim") if mla else None,
        q_lora_rank=cfg.get("q_lora_rank") if mla else None,
        qk_nope_head_dim=cfg.get("qk_nope_head_dim") if mla else None,
        v_head_dim=cfg.get("v_head_dim") if mla else None,
        linear=linear,
        num_experts=int(experts),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(shared),
        first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        mtp_layers=_mtp_layers(cfg, config),
        quant_method=(quant.get("quant_method") if isinstance(quant, dict) else None),
        vision_params=_vision_params(config),
        attn_output_gate=bool(cfg.get("attn_output_gate")),
        raw=config,
    )

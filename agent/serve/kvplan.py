"""KV-cache capacity: how many tokens fit on the GPUs, the context each agent gets, how many agents fit.

KV bytes per token = attention layers x KV heads x head dim x 2 (K and V) x bytes per element
(MLA models store one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer instead), per layer
kind: Gemma 4's full-attention layers have their own heads and head dim. Sliding-window layers stop
growing at their window and linear-attention layers hold a fixed state per sequence, so the memory
of one sequence is computed per layer kind, not as tokens x a constant. With tensor parallelism a
GPU holds at least one KV head (heads are replicated when GPUs outnumber them) and every GPU holds
the whole MLA latent. FP8 weights leave embeddings, lm_head and the vision tower in bf16.

What one request holds is counted as vLLM 0.32 reserves it (``max_memory_usage_bytes`` of each
KV cache spec in ``vllm/v1/kv_cache_interface.py``): a sliding-window layer its window less one
plus the tokens in flight (two batches of ``max_num_batched_tokens`` under async scheduling on a
GPU; the whole prompt on the CPU, which prefills it in one step); a linear-attention (Gated
DeltaNet) layer ``2 + k`` states with prefix caching on (``mamba_cache_mode`` "align": the running
state, the last block-aligned one, one per drafted token) and ``1 + k`` without; an MTP drafter
its layers' full-attention KV and weights; a separate drafter model (``Drafter``) its weights and
its own KV per token, out of the same GPU memory. A hybrid (linear + full attention) is laid out
in vLLM's pages (``ModelShape.hybrid_layout``: one page size, layers grouped by kind and
padded); ``tests/test_families_vllm.py`` and ``tests/test_serve_mtp_cpu.py`` check the plan against
the capacity vLLM reports at start-up within ``VLLM_TOLERANCE``.

The inputs come from the flags `agent serve` chooses (``flags.select_flags``), which `agent plan`
(``plan_cli.py``) prints as a table (``kvplan_text.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from agent.serve import hub
from agent.serve.gpu import GPU
from agent.serve.model_config import ModelShape, load_model_config, model_shape

GIB = 1024**3
# Beyond weights and KV cache, each GPU holds activations, CUDA graphs and communication buffers;
# vLLM measures the real peak at start-up, this is the planning allowance for it.
GPU_OVERHEAD_GIB = 2.0
DEFAULT_UTILIZATION = 0.90
MIN_CONTEXT = 1024  # below this an agent cannot hold its tools and instructions
CONTEXT_STEP = 256  # max-model-len is rounded down to a multiple of this
# what the plan leaves to vLLM (a non-hybrid's rounding to whole blocks): the tests hold the plan
# to this against vLLM's own start-up figure (measured: 0.2% for Gemma 3 and 4, under 0.1% for
# Qwen3.5 with and without MTP)
VLLM_TOLERANCE = 0.01

_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2}
# Drafters whose layers all read the target's KV cache and hold none of their own (vLLM 0.32's
# Gemma 4 MTP path: vllm/model_executor/models/gemma4_mtp.py, config/speculative.py)
KV_SHARING_DRAFTERS = ("gemma4_assistant", "gemma4_unified_assistant")
# A drafter whose config.json is not in the cache yet is planned with a stand-in rather than
# refused: `agent serve --explain` and `agent plan` run where the weights are not (a laptop, a
# login node before fetch_model, which fetches drafters beside the model), and vLLM itself will
# not start without the drafter, so the stand-in only ever shapes an explanation. vLLM runs a
# drafter of method "mtp" (the catalogue's Gemma 4 assistants) as an MTP module: the stand-in is
# one of the model's own MTP layers, weights and one full-attention layer of KV (Gemma-4-31B's
# assistant: 4 small layers, about 0.5 B parameters, no KV of its own). Any other drafter errs on
# the large side: drafters worth their cost are a few per cent of their target (Qwen3-0.6B is 2% of
# Qwen3-32B, 7% of Qwen3-8B), and one no deeper or wider than its target holds at most the KV
# per token of the target's full-attention layers.
STAND_IN_WEIGHTS_SHARE = 0.10


@dataclass(frozen=True)
class Drafter:
    """A drafter model beside the target (the ``model`` of ``--speculative-config``): its weights
    and its own KV cache come out of the same GPU memory. ``shape`` None: its config.json could
    not be read (``missing`` says why), and the plan holds the stand-in above."""

    model: str
    shape: ModelShape | None
    missing: str = ""
    method: str | None = None  # the speculative method vLLM runs it with ("mtp"), if named

    @property
    def holds_kv(self) -> bool:
        return self.shape is None or self.shape.raw.get("model_type") not in KV_SHARING_DRAFTERS


def read_drafter(model: str, method: str | None = None) -> Drafter:
    """The drafter's config.json from its folder or the local Hub cache, offline as vLLM reads
    it; one not fetched yet is a ``Drafter`` without shape, a broken one an error."""
    try:
        path = hub.resolve(model).path
    except hub.ModelNotFound as exc:
        return Drafter(model, None, str(exc), method)
    return Drafter(model, model_shape(load_model_config(path)), method=method)


@dataclass(frozen=True)
class KVPlan:
    """One plan's figures and the arithmetic on them (what a sequence of some length holds, how
    many fit); ``kvplan_text`` puts them in words."""

    shape: ModelShape
    gpu: GPU
    params: int
    weight_dtype: str
    weight_bytes: float
    kv_dtype: str
    kv_bytes: float
    gpu_memory_utilization: float
    weights_gib: float
    overhead_gib: float
    kv_budget_gib: float
    agents: int
    context_per_agent: int  # tokens each of ``agents`` concurrent sequences can hold
    max_model_len: int
    max_num_seqs: int  # sequences of max_model_len that fit, capped at ``agents``
    seqs_fit_at_max_len: int
    tp: int = 1  # GPUs the KV heads are split over
    in_flight: int | None = 0  # tokens in flight beside a sliding window (None: whole prompt)
    linear_states: int = 1  # linear-attention states vLLM keeps per sequence
    mtp_layers: int = 0  # MTP layers drafting, each with a full layer's KV
    speculative_tokens: int = 0
    sliding_kv_bytes: float | None = None  # sliding layers' KV dtype where FP8 skips them
    drafter: Drafter | None = None
    drafter_weights_gib: float = 0.0

    def sequence_bytes(self, tokens: int) -> float:
        """Cache bytes one sequence of ``tokens`` holds, as vLLM reserves them (the drafter's
        own KV included)."""
        return _sequence_bytes(
            self.shape, self.drafter, tokens, self.kv_bytes, self.tp, self.mtp_layers, self.held()
        )

    def drafter_sequence_bytes(self, tokens: int) -> float:
        return drafter_sequence_bytes(
            self.drafter, self.shape, tokens, self.kv_bytes, self.tp, **self.held()
        )

    def held(self) -> dict[str, Any]:
        """How a sequence holds its cache beside its length (``ModelShape.sequence_bytes``)."""
        return {
            "in_flight": self.in_flight,
            "linear_states": self.linear_states,
            "sliding_kv_bytes": self.sliding_kv_bytes,
            "draft_tokens": self.speculative_tokens,
            "on_cpu": self.gpu.is_cpu,
        }

    def full_bytes_per_token(self) -> float:
        return _full_bytes_per_token(self.shape, self.kv_bytes, self.tp)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.shape.kv_bytes_per_token(self.kv_bytes, self.tp, self.sliding_kv_bytes)

    @property
    def tokens_fit(self) -> int:
        """Tokens the KV budget holds if every attention layer keeps every token."""
        return int(self.kv_budget_gib * GIB // self.kv_bytes_per_token)

    def seqs_fit(self, tokens: int) -> int:
        return int(self.concurrency(tokens))

    def concurrency(self, tokens: int) -> float:
        """Sequences of ``tokens`` the KV budget holds at once (vLLM's "maximum concurrency")."""
        return self.kv_budget_gib * GIB / self.sequence_bytes(tokens)

    def layer_kv_bytes(self, kind: str) -> float:
        """Bytes of one KV element in ``kind`` layers (sliding ones may keep the model's dtype)."""
        if kind == "sliding" and self.sliding_kv_bytes is not None:
            return self.sliding_kv_bytes
        return self.kv_bytes

    def linear_state_mib(self) -> float:
        """One sequence's state over the linear layers, as this platform keeps it."""
        return self.shape.linear_state_bytes(self.speculative_tokens, self.gpu.is_cpu) / 2**20


def _full_bytes_per_token(shape: ModelShape, kv_bytes: float, tp: int) -> float:
    """KV bytes per token of a model's full-attention layers."""
    return shape.count("full") * shape.kv_bytes_per_token_per_layer(kv_bytes, "full", tp)


def _sequence_bytes(
    shape: ModelShape,
    drafter: Drafter | None,
    tokens: int,
    kv_bytes: float,
    tp: int,
    mtp_layers: int,
    held: dict[str, Any],
) -> float:
    """The model's and its drafter's cache for one sequence: the sum ``KVPlan.sequence_bytes``
    reports and ``plan_capacity`` searches with before the plan exists."""
    return shape.sequence_bytes(
        tokens, kv_bytes, tp, mtp_layers=mtp_layers, **held
    ) + drafter_sequence_bytes(drafter, shape, tokens, kv_bytes, tp, **held)


def drafter_sequence_bytes(
    drafter: Drafter | None,
    target: ModelShape,
    tokens: int,
    kv_bytes: float,
    tp: int,
    **held: Any,
) -> float:
    """The drafter's own KV for a sequence of ``tokens``: its layers at the KV cache's dtype (one
    cache config for both models), held as the target's are (``held``: in flight, linear states,
    sliding dtype); for a stand-in, one or all of the target's full-attention layers' KV per
    token (see STAND_IN_WEIGHTS_SHARE)."""
    if drafter is None or not drafter.holds_kv:
        return 0.0
    if drafter.shape is None and drafter.method == "mtp":
        return tokens * target.kv_bytes_per_token_per_layer(kv_bytes, "full", tp)
    if drafter.shape is None:
        return tokens * _full_bytes_per_token(target, kv_bytes, tp)
    return drafter.shape.sequence_bytes(tokens, kv_bytes, tp, **held)


def _weights_gib(shape: ModelShape, n_params: int, wbytes: float, vision: int) -> float:
    """Weights in GiB; FP8 (online or in the checkpoint) quantizes the layers' linear weights
    only, so embeddings, lm_head and the vision tower keep the model's dtype."""
    kept = min(n_params, shape.embedding_params() + vision) if wbytes < shape.dtype_bytes else 0
    return ((n_params - kept) * wbytes + kept * shape.dtype_bytes) / GIB


def _drafter_weights_gib(
    drafter: Drafter | None, target: ModelShape, target_weights_gib: float
) -> float:
    """A drafter's weights as the target's are counted (text model, from its config, at its
    checkpoint's dtype: vLLM quantizes a drafter only as its own checkpoint says); a stand-in's
    as STAND_IN_WEIGHTS_SHARE says."""
    if drafter is None:
        return 0.0
    if drafter.shape is None and drafter.method == "mtp":
        return replace(target, mtp_layers=1).mtp_params() * target.dtype_bytes / GIB
    if drafter.shape is None:
        return STAND_IN_WEIGHTS_SHARE * target_weights_gib
    d = drafter.shape
    wbytes = 1 if d.checkpoint_fp8 else d.dtype_bytes
    return _weights_gib(d, d.param_count() - d.vision_params, wbytes, 0)


def _bytes_for(dtype: str, default: float, what: str) -> float:
    if dtype == "auto":
        return default
    if dtype not in _BYTES:
        raise ValueError(f"{what} {dtype!r}: expected one of auto, {', '.join(_BYTES)}")
    return _BYTES[dtype]


def in_flight_tokens(gpu: GPU) -> int | None:
    """Tokens vLLM 0.32 may have in flight per request beside a sliding window: two batches
    (async scheduling) of its default ``max_num_batched_tokens`` for an API server on this GPU
    (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``); None on the CPU, where
    the flags prefill a whole prompt in one step."""
    if gpu.is_cpu:
        return None
    if gpu.memory_gib >= 160:
        batched = 16384
    elif gpu.memory_gib >= 70 and "A100" not in gpu.name.upper():
        batched = 8192
    else:
        batched = 2048
    return 2 * batched


def plan_capacity(
    shape: ModelShape,
    gpu: GPU,
    *,
    agents: int = 8,
    kv_dtype: str = "auto",
    weight_dtype: str = "auto",
    max_model_len: int | None = None,
    gpu_memory_utilization: float = DEFAULT_UTILIZATION,
    params: int | None = None,
    language_model_only: bool = False,
    prefix_caching: bool = True,
    speculative_tokens: int = 0,
    mtp: bool = False,
    skip_sliding: bool = False,
    drafter: Drafter | None = None,
) -> KVPlan:
    """Plan KV capacity; ``auto`` dtypes follow the checkpoint (FP8 checkpoints count 1 byte for
    the layers' weights). ``language_model_only``: the vision tower is not loaded.
    ``speculative_tokens`` drafted per step, by the model's MTP layers when ``mtp``.
    ``skip_sliding``: sliding-window layers keep the model's dtype under a quantised KV cache
    (`--kv-cache-dtype-skip-layers sliding_window`). ``drafter``: a separate drafter model, whose
    weights and own KV share the GPUs."""
    if agents < 1:
        raise ValueError(f"agents {agents}: expected at least 1")
    vision = shape.vision_params if not language_model_only else 0
    mtp_layers = shape.mtp_layers if mtp and speculative_tokens else 0
    n_params, wbytes, weights_gib = _weights(shape, params, weight_dtype, vision, mtp_layers)
    kbytes = _bytes_for(kv_dtype, shape.dtype_bytes, "KV cache dtype")
    sliding_bytes = shape.dtype_bytes if skip_sliding and kbytes < shape.dtype_bytes else None
    drafter_gib = _drafter_weights_gib(drafter, shape, weights_gib)
    tp = 1 if gpu.is_cpu else gpu.count
    overhead, budget = _kv_budget_gib(
        shape, gpu, gpu_memory_utilization, weights_gib, drafter_gib, drafter
    )
    budget_bytes = budget * GIB
    held = {
        "in_flight": in_flight_tokens(gpu),
        # vLLM's "align" mode with prefix caching, else one running state, each + drafts
        "linear_states": (2 if prefix_caching else 1) + speculative_tokens,
        "sliding_kv_bytes": sliding_bytes,
    }
    # what sizes a hybrid's pages: the conv window holds the drafts, blocks grow in platform steps
    pages = {"draft_tokens": speculative_tokens, "on_cpu": gpu.is_cpu}

    def seq_bytes(tokens: int) -> float:
        return _sequence_bytes(shape, drafter, tokens, kbytes, tp, mtp_layers, {**held, **pages})

    context = _longest_context(seq_bytes, agents, budget_bytes, shape.max_position_embeddings)
    max_len = _max_model_len(shape, gpu, agents, context, max_model_len)
    seqs_fit = int(budget_bytes // seq_bytes(max_len))
    if seqs_fit < 1:
        raise ValueError(
            f"{shape.source}: not even one sequence of {max_len} tokens fits in {budget:.1f} GiB"
        )
    return KVPlan(
        shape=shape,
        gpu=gpu,
        params=n_params,
        weight_dtype=_dtype_name(wbytes),
        weight_bytes=wbytes,
        kv_dtype=_dtype_name(kbytes),
        kv_bytes=kbytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_gib=weights_gib,
        overhead_gib=overhead,
        kv_budget_gib=budget,
        agents=agents,
        context_per_agent=context,
        max_model_len=max_len,
        max_num_seqs=min(agents, seqs_fit),
        seqs_fit_at_max_len=seqs_fit,
        tp=tp,
        mtp_layers=mtp_layers,
        speculative_tokens=speculative_tokens,
        drafter=drafter,
        drafter_weights_gib=drafter_gib,
        **held,
    )


def _kv_budget_gib(
    shape: ModelShape,
    gpu: GPU,
    utilization: float,
    weights_gib: float,
    drafter_gib: float,
    drafter: Drafter | None,
) -> tuple[float, float]:
    """(overhead, KV budget) in GiB: what the GPUs' share leaves after the weights (the model's
    and a drafter's) and the overhead, or an error saying the weights do not fit."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization {utilization}: expected 0 < u <= 1")
    if gpu.is_cpu:  # weights live in host RAM beside a fixed KV space
        return 0.0, gpu.memory_gib
    overhead = GPU_OVERHEAD_GIB * gpu.count
    budget = gpu.count * gpu.memory_gib * utilization - weights_gib - drafter_gib - overhead
    if budget <= 0:
        drafted = f" (+ {drafter_gib:.1f} GiB of drafter)" if drafter else ""
        raise ValueError(
            f"{shape.source}: weights need {weights_gib:.1f} GiB{drafted} but {gpu.label()}"
            f" at utilisation {utilization:g} leaves"
            f" {budget + weights_gib + drafter_gib:.1f} GiB; use more GPUs (--gpus) or FP8"
            " weights"
        )
    return overhead, budget


def _weights(
    shape: ModelShape, params: int | None, weight_dtype: str, vision: int, mtp_layers: int
) -> tuple[int, float, float]:
    """(parameters, bytes per weight, GiB) of the weights loaded: ``params`` where given, else
    the config's count with the vision tower loaded (``vision``) and drafting MTP layers."""
    n_params = params if params is not None else shape.param_count() - shape.vision_params + vision
    if params is None and mtp_layers:
        n_params += shape.mtp_params()
    wbytes = _bytes_for(
        weight_dtype, 1 if shape.checkpoint_fp8 else shape.dtype_bytes, "weight dtype"
    )
    return n_params, wbytes, _weights_gib(shape, n_params, wbytes, vision)


def _max_model_len(
    shape: ModelShape, gpu: GPU, agents: int, context: int, asked: int | None
) -> int:
    """The context each agent gets (``asked``, else the longest that fits), or an error saying
    why it cannot be served."""
    model_max = shape.max_position_embeddings
    if asked is None and context < MIN_CONTEXT:
        raise ValueError(
            f"{shape.source}: only {context} tokens per agent fit for {agents} agents on "
            f"{gpu.label()}; plan fewer agents, more GPUs or an FP8 KV cache"
        )
    if asked is not None and model_max and asked > model_max:
        raise ValueError(
            f"max_model_len {asked} exceeds the model's max_position_embeddings {model_max}"
        )
    return context if asked is None else asked


def _longest_context(
    seq_bytes: Callable[[int], float], agents: int, budget_bytes: float, model_max: int | None
) -> int:
    """The longest context every one of ``agents`` sequences can hold at once (binary search),
    rounded down to CONTEXT_STEP unless it is the model's own maximum."""
    lo, hi = 0, model_max or 10_000_000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if agents * seq_bytes(mid) <= budget_bytes else (lo, mid - 1)
    return lo if lo == model_max else lo - lo % CONTEXT_STEP


def _dtype_name(nbytes: float) -> str:
    return "fp8" if nbytes == 1 else ("bf16" if nbytes == 2 else f"{nbytes:g} B")

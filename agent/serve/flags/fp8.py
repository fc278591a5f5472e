"""Layer 2, FP8: FP8 weights only where FP8 tensor cores exist (compute capability 8.9+: H100,
H200, L40S; not A100), as vLLM 0.32's online ``fp8_per_tensor`` (``fp8`` now means an FP8
checkpoint only), or the publisher's FP8 checkpoint where the catalogue names one; FP8 KV cache on
A100 and H100 alike (cc 8.0+), leaving sliding-window layers at the model's dtype.

``choose`` decides both once, before the KV plan, which counts their bytes; ``flags`` explains
the choice with the plan's figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.serve.flags.plan import CHECKPOINT, Flag, Overrides
from agent.serve.gpu import GPU
from agent.serve.kvplan import GIB, KVPlan
from agent.serve.model_config import ModelShape

FP8_TENSOR_CORES_CC = 8.9  # Ada / Hopper and newer
FP8_KV_CACHE_CC = 8.0  # Ampere and newer
# vLLM 0.32's online FP8 for a bf16 checkpoint (vllm/config/quantization.py _ONLINE_SHORTHANDS);
# its `--quantization fp8` refuses a checkpoint that is not FP8 already.
FP8_ONLINE = "fp8_per_tensor"
LAYER = "fp8"

WeightsRule = Literal["checkpoint", "config off", "config on", "cpu", "tensor cores", "none"]
KVRule = Literal["config off", "cpu", "no kernels", "config on", "auto"]


@dataclass(frozen=True)
class Choice:
    """Whether the weights and the KV cache are FP8, each with the rule that decided it."""

    weights: WeightsRule
    kv: KVRule

    @property
    def fp8_weights(self) -> bool:
        return self.weights in ("config on", "tensor cores")

    @property
    def fp8_kv(self) -> bool:
        return self.kv in ("config on", "auto")


def choose(gpu: GPU, shape: ModelShape, o: Overrides) -> Choice:
    weights: WeightsRule
    if shape.checkpoint_fp8:
        weights = "checkpoint"
    elif o.quantization == "none":
        weights = "config off"
    elif o.quantization == "fp8" and not gpu.is_cpu:
        weights = "config on"
    elif gpu.is_cpu:
        weights = "cpu"
    else:
        weights = "tensor cores" if gpu.cc >= FP8_TENSOR_CORES_CC else "none"
    kv: KVRule
    if o.kv_cache_dtype == "model":
        kv = "config off"
    elif gpu.is_cpu and o.kv_cache_dtype != "fp8":
        kv = "cpu"
    elif not gpu.is_cpu and gpu.cc < FP8_KV_CACHE_CC:
        kv = "no kernels"
    else:
        kv = "config on" if o.kv_cache_dtype == "fp8" else "auto"
    return Choice(weights, kv)


def flags(
    choice: Choice,
    gpu: GPU,
    shape: ModelShape,
    plan: KVPlan,
    plan_model_kv: KVPlan,
    published: str | None,
) -> list[Flag]:
    """FP8 weights (online, or ``published``: the publisher's FP8 checkpoint of the model), the FP8
    KV cache (``plan_model_kv``: the plan had the KV cache kept the model's dtype), and the sliding
    layers it leaves at the model's dtype."""
    weights, checkpoint = _weights(choice, gpu, shape, plan), []
    if weights.chosen and published:
        weights = Flag(
            LAYER,
            "--quantization",
            FP8_ONLINE,
            False,
            "the publisher's FP8 checkpoint is served instead: its weights are FP8 already",
        )
        checkpoint = [_checkpoint(published)]
    kv = _kv(choice, gpu, plan, plan_model_kv)
    return [weights, *checkpoint, kv, *_kv_skip_sliding(shape, kv, plan)]


def _weights(choice: Choice, gpu: GPU, shape: ModelShape, plan: KVPlan) -> Flag:
    cc = f"cc {gpu.cc:.1f}"
    if choice.weights == "checkpoint":
        kernels = (
            "on FP8 tensor cores"
            if gpu.cc >= FP8_TENSOR_CORES_CC
            else "with weight-only FP8 kernels (no FP8 tensor cores here)"
        )
        why = (
            f"the checkpoint is already FP8 (quantization_config.quant_method=fp8); vLLM"
            f" loads it as it is, {'cpu' if gpu.is_cpu else kernels}"
        )
    elif choice.weights == "config off":
        why = "disabled by config (quantization: none)"
    elif choice.weights == "config on":
        why = f"asked by config (quantization: fp8) on {cc}"
    elif choice.weights == "cpu":
        why = "cpu: FP8 weight kernels need a CUDA GPU"
    elif choice.weights == "tensor cores":
        why = (
            f"FP8 tensor cores ({cc} >= {FP8_TENSOR_CORES_CC}): online FP8 weights take"
            f" {plan.weights_gib:.1f} GiB instead of {plan.params * shape.dtype_bytes / GIB:.1f}"
            " (embeddings, lm_head and any vision tower stay bf16) and run the GEMMs at FP8 rate"
        )
    else:
        why = (
            f"{cc} < {FP8_TENSOR_CORES_CC}: no FP8 tensor cores (A100 and older), so FP8"
            " weights would save memory but slow every step"
        )
    return Flag(LAYER, "--quantization", FP8_ONLINE, choice.fp8_weights, why)


def _checkpoint(published: str) -> Flag:
    return Flag(
        LAYER,
        CHECKPOINT,
        published,
        True,
        f"FP8 weights chosen and {published} is the publisher's FP8 checkpoint of this"
        " model (catalogue fp8_checkpoints): its scales were calibrated by the publisher,"
        " not computed online from the bf16 weights at start-up; `fetch_model` fetches it"
        " (fp8_checkpoint: false in the overrides keeps online quantisation)",
        launch=True,
    )


def _kv(choice: Choice, gpu: GPU, plan: KVPlan, plan_model_kv: KVPlan) -> Flag:
    cc = f"cc {gpu.cc:.1f}"
    if choice.kv == "config off":
        why = "disabled by config (kv_cache_dtype: model)"
    elif choice.kv == "cpu":
        why = "cpu: the KV cache keeps the model's dtype"
    elif choice.kv == "no kernels":
        why = f"{cc} < {FP8_KV_CACHE_CC}: no FP8 KV cache kernels"
    else:
        before, length = plan_model_kv.kv_bytes_per_token, plan.max_model_len
        why = (
            f"halves KV bytes per token ({before:,.0f} -> {plan.kv_bytes_per_token:,.0f} B):"
            f" {plan.seqs_fit(length)} sequences of {length:,} tokens fit instead of"
            f" {plan_model_kv.seqs_fit(length)}"
            + (
                " (asked by config)"
                if choice.kv == "config on"
                else f" ({cc} >= {FP8_KV_CACHE_CC})"
            )
        )
    return Flag(LAYER, "--kv-cache-dtype", "fp8", choice.fp8_kv, why)


def _kv_skip_sliding(shape: ModelShape, kv: Flag, plan: KVPlan) -> list[Flag]:
    """Sliding-window layers keep the model's dtype under an FP8 KV cache: they hold only their
    window, so FP8 saves little there, and their few recent tokens are where precision tells."""
    sliding = shape.count("sliding")
    if not (kv.chosen and sliding):
        return []
    window = min(plan.max_model_len, shape.sliding_window or plan.max_model_len)
    per_token = shape.kv_bytes_per_token_per_layer(1, "sliding", plan.tp)  # per byte of dtype
    extra = sliding * window * per_token * (shape.dtype_bytes - plan.kv_bytes)
    fp8 = plan.sequence_bytes(plan.max_model_len) - extra  # had the sliding layers been FP8
    return [
        Flag(
            LAYER,
            "--kv-cache-dtype-skip-layers",
            "sliding_window",
            True,
            f"the {sliding} sliding-window layers hold {window:,} tokens at most: at the model's"
            f" dtype they add {extra / 2**20:,.0f} MiB per sequence ({100 * extra / fp8:.0f}% of"
            f" its {plan.max_model_len:,}-token FP8 KV), and FP8 there would blur the recent"
            " context the model reads most closely",
        )
    ]

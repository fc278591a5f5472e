"""The KV plan in words: the table `agent plan` prints, the lines `agent serve --explain` shows
(``kv_summary``, ``drafter_summary``), and the plan as the endpoint file and `agent plan --json`
record it (``as_dict``: its figures beside the same words). The figures are ``kvplan.KVPlan``'s."""

from __future__ import annotations

from typing import Any

from agent.serve.kvplan import GIB, STAND_IN_WEIGHTS_SHARE, KVPlan

TABLE_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)  # the rows of the table's foot


def layer_summary(plan: KVPlan) -> str:
    s = plan.shape
    parts = [
        f"{s.count(k)} {name}"
        for k, name in (
            ("full", "full attention"),
            ("sliding", f"sliding window {s.sliding_window}"),
            ("linear", "linear attention"),
        )
        if s.count(k)
    ]
    return f"{s.num_layers} layers: " + ", ".join(parts)


def per_token_formula(plan: KVPlan) -> str:
    s = plan.shape
    if s.is_mla:
        attn = s.count("full") + s.count("sliding")
        copies = f" x {plan.tp} GPUs (replicated)" if plan.tp > 1 else ""
        return (
            f"{attn} layers x (kv_lora_rank {s.kv_lora_rank} + rope {s.qk_rope_head_dim})"
            f" x {plan.kv_bytes:g} B (MLA latent){copies}"
        )
    terms = []
    for kind in ("full", "sliding"):
        if not s.count(kind):
            continue
        heads = s.kv_heads(kind)
        shown = f"{heads}" if heads >= plan.tp else f"{plan.tp} (replicated {heads})"
        terms.append(
            f"{s.count(kind)} {kind} layers x {shown} KV heads x {s.layer_head_dim(kind)}"
            f" head dim x 2 (K,V) x {plan.layer_kv_bytes(kind):g} B"
        )
    return " + ".join(terms)


def kv_summary(plan: KVPlan) -> str:
    """Bytes per token of the layers that grow with every token, and of the windowed ones."""
    s = plan.shape
    full = plan.full_bytes_per_token()
    text = f"{full:,.0f} B/token ({plan.kv_dtype}) in {s.count('full')} full-attention layers"
    if plan.mtp_layers:
        text += (
            f" + the same per token in {plan.mtp_layers} MTP layer(s), which keep KV while"
            f" drafting {plan.speculative_tokens} token(s)"
        )
    if s.count("sliding"):
        sliding = s.count("sliding") * s.kv_bytes_per_token_per_layer(
            plan.layer_kv_bytes("sliding"), "sliding", plan.tp
        )
        held = s.sliding_tokens(plan.max_model_len, plan.in_flight)
        why = (
            "the whole prompt is prefilled in one step"
            if plan.in_flight is None
            else f"window {s.sliding_window:,} - 1 + {plan.in_flight:,} tokens in flight"
        )
        text += (
            f" + {sliding:,.0f} B/token in {s.count('sliding')} sliding-window layers that keep"
            f" at most {held:,} tokens ({why})"
        )
    if s.linear is not None:
        text += (
            f" + {plan.linear_states} x {plan.linear_state_mib():,.1f} MiB of"
            f" linear-attention state per sequence ({_linear_states_reason(plan)})"
        )
        if s.count("full") + plan.mtp_layers:
            text += f", {_pages(plan)}"
    return f"{text}; {per_token_formula(plan)}"


def _pages(plan: KVPlan) -> str:
    """How vLLM pages a hybrid's cache (``ModelShape.hybrid_layout``), in words."""
    s = plan.shape
    block, full, linear = s.hybrid_layout(
        plan.kv_bytes, plan.tp, plan.mtp_layers, plan.speculative_tokens, plan.gpu.is_cpu
    )
    padded = s.count("linear") != linear or s.count("full") + plan.mtp_layers != full
    return f"in vLLM's pages: {block:,}-token attention blocks, each page one layer's state" + (
        f"; layers grouped as {full} attention and {linear} linear, padding included"
        if padded
        else ""
    )


def drafter_summary(plan: KVPlan) -> str | None:
    """The drafter's share of the GPU memory and why, or None without a drafter."""
    d = plan.drafter
    if d is None:
        return None
    weights = f"weights {plan.drafter_weights_gib:.1f} GiB"
    if d.shape is None:
        kv = f"{plan.drafter_sequence_bytes(1):,.0f} B/token of its own KV"
        stand_in = (
            f"one of the model's own MTP layers, as vLLM's mtp method runs it: {weights},"
            f" {kv} (one full-attention layer)"
            if d.method == "mtp"
            else f"{weights} ({STAND_IN_WEIGHTS_SHARE:.0%} of the model's; drafters worth"
            f" running are a few per cent of their target) and {kv} (as much as the model's"
            " full-attention layers: a drafter is no deeper or wider than its target)"
        )
        return (
            f"{d.model}: its config.json cannot be read ({d.missing}); planned with a stand-in"
            f" until it is: {stand_in}"
        )
    s = d.shape
    held = f"{s.num_layers} layers, {s.param_count() / 1e9:.2f} B parameters"
    if not d.holds_kv:
        return (
            f"{d.model} ({held}): {weights}; no KV of its own (its layers read the model's"
            f" KV cache: vLLM's {s.raw.get('model_type')} path)"
        )
    per_token = s.kv_bytes_per_token(plan.kv_bytes, plan.tp, plan.sliding_kv_bytes)
    length = plan.max_model_len
    return (
        f"{d.model} ({held}): {weights} and its own KV cache, {per_token:,.0f} B/token"
        f" ({plan.kv_dtype}) in its attention layers:"
        f" {plan.drafter_sequence_bytes(length) / GIB:.2f} GiB of each {length:,}-token"
        f" sequence's {plan.sequence_bytes(length) / GIB:.2f} GiB"
    )


def _linear_states_reason(plan: KVPlan) -> str:
    k = plan.speculative_tokens
    drafted = f" + {k} drafted" if k else ""
    if plan.linear_states == 2 + k:
        return f"prefix caching keeps the running and the last block-aligned state{drafted}"
    return f"the running state{drafted}"


def as_dict(plan: KVPlan) -> dict[str, Any]:
    return {
        "model": plan.shape.source,
        "model_type": plan.shape.model_type,
        "layers": layer_summary(plan),
        "params": plan.params,
        "weight_dtype": plan.weight_dtype,
        "weights_gib": round(plan.weights_gib, 2),
        "gpu": plan.gpu.to_dict(),
        "gpu_memory_utilization": plan.gpu_memory_utilization,
        "overhead_gib": plan.overhead_gib,
        "kv_dtype": plan.kv_dtype,
        "kv_budget_gib": round(plan.kv_budget_gib, 2),
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_formula": per_token_formula(plan),
        "tensor_parallel": plan.tp,
        "linear_state_bytes_per_seq": plan.linear_states
        * plan.shape.linear_state_bytes(plan.speculative_tokens, plan.gpu.is_cpu),
        "linear_states_per_seq": plan.linear_states,
        "mtp_kv_layers": plan.mtp_layers,
        "sliding_in_flight_tokens": plan.in_flight,
        "speculative_tokens": plan.speculative_tokens,
        "drafter": None
        if plan.drafter is None
        else {
            "model": plan.drafter.model,
            "config_read": plan.drafter.shape is not None,
            "weights_gib": round(plan.drafter_weights_gib, 2),
            "kv_bytes_at_max_model_len": plan.drafter_sequence_bytes(plan.max_model_len),
            "reason": drafter_summary(plan),
        },
        "tokens_fit": plan.tokens_fit,
        "agents": plan.agents,
        "context_per_agent": plan.context_per_agent,
        "max_model_len": plan.max_model_len,
        "max_num_seqs": plan.max_num_seqs,
        "seqs_fit_at_max_len": plan.seqs_fit_at_max_len,
    }


def table(plan: KVPlan) -> str:
    s, g = plan.shape, plan.gpu
    if g.is_cpu:
        budget = f"{plan.kv_budget_gib:.1f} GiB (VLLM_CPU_KVCACHE_SPACE)"
    else:
        drafter = f" - drafter {plan.drafter_weights_gib:.1f}" if plan.drafter is not None else ""
        budget = (
            f"{plan.kv_budget_gib:.1f} GiB = {g.count} x {g.memory_gib:g} GiB x "
            f"{plan.gpu_memory_utilization:g} - weights {plan.weights_gib:.1f}{drafter}"
            f" - overhead {plan.overhead_gib:g}"
        )
    rows = [
        ("model", f"{s.source} ({s.model_type}, {layer_summary(plan)})"),
        (
            "parameters",
            f"{plan.params / 1e9:.2f} B, {plan.weight_dtype} weights: {plan.weights_gib:.1f} GiB",
        ),
        ("device", g.label()),
        ("KV cache budget", budget),
        (
            "KV bytes/token",
            f"{plan.kv_bytes_per_token:,.0f} B ({plan.kv_dtype}) = {per_token_formula(plan)}",
        ),
    ]
    if s.count("sliding"):
        rows.append(
            (
                "sliding window",
                f"{s.count('sliding')} layers keep at most {s.sliding_window} tokens",
            )
        )
    if s.linear is not None:
        rows.append(
            (
                "linear state",
                f"{plan.linear_states} x {plan.linear_state_mib():,.1f} MiB per"
                f" sequence, any length ({_linear_states_reason(plan)})",
            )
        )
    if plan.mtp_layers:
        rows.append(
            (
                "MTP",
                f"{plan.mtp_layers} layer(s) draft {plan.speculative_tokens} token(s): their"
                " weights, and KV per token as a full-attention layer",
            )
        )
    if plan.drafter is not None:
        rows.append(("drafter", drafter_summary(plan)))
    rows += [
        ("tokens that fit", f"{plan.tokens_fit:,} (every attention layer holding every token)"),
        (
            "agents",
            f"{plan.agents} -> {plan.context_per_agent:,} tokens of context each"
            f" (model max {s.max_position_embeddings or 'unknown'})",
        ),
        (
            "max-model-len",
            f"{plan.max_model_len:,}  ({plan.seqs_fit_at_max_len} sequences of it fit;"
            f" max-num-seqs {plan.max_num_seqs})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", f"{'context':>10}  {'agents that fit':>15}  {'GiB per agent':>13}"]
    limit = s.max_position_embeddings or max(TABLE_CONTEXTS)
    for ctx in [c for c in TABLE_CONTEXTS if c <= limit]:
        per = plan.sequence_bytes(ctx) / GIB
        lines.append(f"{ctx:>10,}  {plan.seqs_fit(ctx):>15,}  {per:>13.2f}")
    return "\n".join(lines)

"""Layer 1, CUDA graphs: never ``--enforce-eager`` unless the config asks; capture sizes fitted
to the agents times the tokens each verifies per step (1 + draft tokens)."""

from __future__ import annotations

from agent.serve.flags.plan import Flag, Overrides
from agent.serve.gpu import GPU
from agent.serve.kvplan import KVPlan


def _capture_size(tokens: int) -> int:
    """vLLM captures [1, 2, 4, 8, 16, ...]; the largest must cover a decode batch of every agent."""
    return tokens if tokens <= 4 else -(-tokens // 8) * 8


def flags(gpu: GPU, o: Overrides, plan: KVPlan, draft: int) -> list[Flag]:
    layer = "cuda-graphs"
    if o.enforce_eager:
        return [
            Flag(
                layer,
                "--enforce-eager",
                None,
                True,
                "asked by config (enforce_eager: true): no CUDA graphs and no torch.compile",
            )
        ]
    if gpu.is_cpu:
        return [
            Flag(
                layer,
                "--enforce-eager",
                None,
                False,
                "cpu: there are no CUDA graphs; vLLM's CPU backend compiles with torch.compile",
            )
        ]
    tokens = plan.max_num_seqs * (1 + draft)
    size = _capture_size(tokens)
    batch = (
        f"{plan.max_num_seqs} planned concurrent agents x (1 + {draft} draft tokens) = {tokens}"
        " tokens verified per step"
        if draft
        else f"the {plan.max_num_seqs} planned concurrent agents"
    )
    return [
        Flag(
            layer,
            "--enforce-eager",
            None,
            False,
            "CUDA graphs stay on: each decode step replays a captured graph instead of launching"
            " every kernel, which dominates small-batch agent decoding",
        ),
        Flag(
            layer,
            "--max-cudagraph-capture-size",
            str(size),
            True,
            f"capture batch sizes up to {size}, enough for {batch}, without spending start-up"
            " time and memory on batch sizes they never reach",
        ),
    ]

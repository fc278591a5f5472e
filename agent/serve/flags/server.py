"""The server's flags beside the four layers and the family's: tensor parallelism from the GPU
count, ``--max-model-len`` / ``--max-num-seqs`` from the KV plan, the seed, per-request timing,
and the CPU backend's environment."""

from __future__ import annotations

from agent.serve.flags.plan import Flag, Overrides
from agent.serve.gpu import GPU
from agent.serve.kvplan import KVPlan
from agent.serve.model_config import ModelShape


def capacity(gpu: GPU, shape: ModelShape, o: Overrides, plan: KVPlan) -> list[Flag]:
    layer = "capacity"
    flags = []
    if gpu.is_cpu:
        flags.append(Flag(layer, "--tensor-parallel-size", None, False, "cpu: one process"))
    elif gpu.count > 1:
        if shape.num_attention_heads % gpu.count:
            raise ValueError(
                f"{shape.source}: {shape.num_attention_heads} attention heads do not split over"
                f" {gpu.count} GPUs (tensor parallel needs a divisor)"
            )
        flags.append(
            Flag(
                layer,
                "--tensor-parallel-size",
                str(gpu.count),
                True,
                f"{gpu.count} GPUs allocated: weights and KV heads are sharded over all of them",
            )
        )
    else:
        flags.append(Flag(layer, "--tensor-parallel-size", None, False, "one GPU allocated"))
    if o.max_model_len is None:
        why = (
            f"{plan.agents} agents x {plan.max_model_len:,} tokens fit in the"
            f" {plan.kv_budget_gib:.1f} GiB KV budget at {plan.kv_dtype}"
        )
        if shape.max_position_embeddings and plan.max_model_len == shape.max_position_embeddings:
            why += " (the model's full context)"
    else:
        why = f"asked by config; {plan.seqs_fit_at_max_len} sequences of it fit in the KV budget"
    flags.append(Flag(layer, "--max-model-len", str(plan.max_model_len), True, why))
    flags.append(
        Flag(
            layer,
            "--max-num-seqs",
            str(plan.max_num_seqs),
            True,
            f"{plan.agents} agents planned, {plan.seqs_fit_at_max_len} full-length sequences"
            " fit: every agent is served at once, none is preempted",
        )
    )
    if gpu.is_cpu:
        flags.extend(
            (
                Flag(
                    layer,
                    "--gpu-memory-utilization",
                    None,
                    False,
                    "cpu: the KV cache size is VLLM_CPU_KVCACHE_SPACE",
                ),
                Flag(
                    layer,
                    "--max-num-batched-tokens",
                    str(plan.max_model_len),
                    True,
                    "cpu: a whole prompt is prefilled in one step; vLLM 0.32's CPU worker dies on a"
                    " seeded request whose prompt is prefilled in chunks ('CPU Generator does not use"
                    " offset'), and every agent request is seeded",
                ),
            )
        )
    else:
        flags.append(
            Flag(
                layer,
                "--gpu-memory-utilization",
                f"{o.gpu_memory_utilization:g}",
                True,
                f"the KV plan's budget assumes this share of each GPU's {gpu.memory_gib:g} GiB",
            )
        )
    flags.append(
        Flag(layer, "--seed", str(o.seed), True, "recorded sampling seed (reproducibility)")
    )
    return flags


def measurement() -> list[Flag]:
    return [
        Flag(
            "measurement",
            "--enable-per-request-metrics",
            None,
            True,
            "each reply carries its own queue, time-to-first-token and decode seconds, which the"
            " agent writes into every step's metrics row",
        )
    ]


def environment(gpu: GPU) -> list[Flag]:
    if not gpu.is_cpu:
        return []
    return [
        Flag(
            "environment",
            "VLLM_CPU_KVCACHE_SPACE",
            f"{gpu.memory_gib:g}",
            True,
            "KV cache space of the CPU backend in GiB (the KV plan's budget)",
            env=True,
        ),
        Flag(
            "environment",
            "VLLM_CPU_OMP_THREADS_BIND",
            "nobind",
            True,
            "let the OS place OpenMP threads: on a shared node the cores are not ours alone",
            env=True,
        ),
    ]

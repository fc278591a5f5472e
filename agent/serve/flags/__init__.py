"""vLLM flags as a pure function of (GPU, model config, overrides, catalogue), each with the reason it was chosen or left out.

The four layers that make each agent step fast, a module each: ``cuda_graphs`` (1), ``fp8`` (2:
weights and KV cache, decided once), ``prefix_caching`` (3), ``speculative`` (4: MTP or a
drafter); ``server``: tensor parallelism, ``--max-model-len`` / ``--max-num-seqs`` from the KV
plan, per-request timing, the CPU backend's environment; ``family``: the tool-call and reasoning
parsers, chat template and text-only serving of the model's family in the catalogue
(agent/serve/models.yaml); ``plan``: the overrides, a flag and the plan of all of them;
``selection``: ``select_flags``, which chooses them all.

Nothing here touches the machine but a drafter's config.json, read offline from its folder or the
local Hub cache for the KV plan: the same inputs give the same flags, so they can be explained for
an H100 on a laptop and recorded in the endpoint file. `agent serve` and `agent plan` both plan
through ``select_flags``, so they print one capacity.
"""

from agent.serve.flags.selection import select_flags

__all__ = ["select_flags"]

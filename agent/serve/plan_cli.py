"""``python -m agent plan``: the KV plan `agent serve` would make, as a table or JSON.

It takes the options `agent serve` chooses its flags from (model, catalogue, GPU, agents, context
length, overrides) and goes the same way (``launch.choose_flags`` -> ``flags.select_flags``), so
for one model and GPU both print one plan: FP8 weights (or the publisher's FP8 checkpoint) and
FP8 KV cache where serve chooses them, prefix caching, MTP layers or a drafter model, and the
sliding layers an FP8 cache skips. ``--override kv_cache_dtype=model`` and the like plan another
choice, as they serve one.
"""

from __future__ import annotations

import argparse
import json

from agent import say
from agent.serve import kvplan_text, launch
from agent.serve.model_config import ModelConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launch.add_selection_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def main(args: argparse.Namespace) -> int:
    try:
        if bool(args.model) == bool(args.model_config):
            raise ValueError("give one of --model (a directory or a Hub id) and --model-config")
        _, chosen = launch.choose_flags(args)
    except (ModelConfigError, ValueError) as exc:  # hub, catalogue and GPU errors too
        say.error(str(exc))
        return 2
    plan = chosen.plan
    print(json.dumps(kvplan_text.as_dict(plan), indent=1) if args.json else kvplan_text.table(plan))
    return 0

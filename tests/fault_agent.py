"""``python -m tests.fault_agent ARGS``: ``agent run --policy llm`` whose every request goes to
the real server, and meets its faults, but whose tool calls come from the reference policy.

A random-weight model's calls would end the run within a few steps, long before the faults under
test; with the reference's calls the run is a whole analysis whose record can be compared with an
uninterrupted one. Everything else (runner, loop, LLMPolicy, waits, resume) is the real path.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from agent import cli, runner
from agent.policies import PolicySetup
from agent.policies.base import Decision
from agent.policies.reference import ReferencePolicy

_make_policy = runner.make_policy


class ServerThenReference:
    def __init__(self, llm: Any, registry: Any):
        self.llm, self.reference = llm, ReferencePolicy(registry)

    def decide(self, messages, tools, world) -> Decision:
        reply = self.llm.decide(messages, tools, world)
        planned = self.reference.decide(messages, tools, world)
        return Decision(planned.calls, reply.text, reply.usage, reply.finish_reason, reply.outages)


def make_policy(config, registry) -> PolicySetup:
    setup = _make_policy(config, registry)
    return replace(setup, policy=ServerThenReference(setup.policy, registry))


if __name__ == "__main__":
    runner.make_policy = make_policy
    sys.exit(cli.main(["run", *sys.argv[1:]]))

"""A session without data, for loops whose tool results stand for themselves (a scripted
session's recorded results, a benchmark's built ones): the loop asks it only for a digest and a
checkpoint, and the registry for the tools done."""

from __future__ import annotations


class NullSession:
    def __init__(self):
        self.done: set[str] = set()

    def digest(self) -> str:
        return "0" * 32  # a digest's size, so that a record's entries are as long as a real run's

    def after_step(self, step: int, tool: str, spec: object) -> None:
        return None

"""Deciders of the next tool call: one loop, three policies (LLM, reference recipe, replay)."""

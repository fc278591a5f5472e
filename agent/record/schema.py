"""``python -m agent.record.schema``: the JSON schema of world_state.json, generated from the
record's models (agent/record/models.py). The checked-in copy, agent/schemas/world_state.schema.json,
is this output; tests/test_record_models.py keeps them equal."""

from __future__ import annotations

import json
from typing import Any

from agent.record.models import ENTRY_STATUS_RULES, WorldStateFile

ID = "https://example.org/scagent/world_state.schema.json"


def schema() -> dict[str, Any]:
    generated = WorldStateFile.model_json_schema()
    generated["$defs"]["StepEntry"]["allOf"] = ENTRY_STATUS_RULES
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": ID, **generated}


def text() -> str:
    """The schema as the checked-in file holds it."""
    return json.dumps(schema(), indent=2) + "\n"


if __name__ == "__main__":
    print(text(), end="")

"""The eval_min_score rule: the llm samples are analysed only when the model's evaluation
(`agent eval`'s eval.json) scored at least config eval.min_score.

Below it (or without a score: no decision point was evaluated) the job fails with one line naming
the score, the minimum, the model and the evaluation's page, and no llm sample is analysed; else
it writes its output, which the analyze jobs need: the score, the minimum and the model.
"""

# No `from __future__` here: Snakemake's script directive puts its preamble before this line.
import json
import sys
from pathlib import Path


def model_name(model: dict) -> str:
    """The evaluated model as eval.json names it: Hub id at revision, else the served name."""
    if model.get("model_id"):
        return f"{model['model_id']} at revision {model.get('revision') or 'unknown'}"
    return model.get("model") or model.get("policy") or "unknown"


def check(evaluation: Path, min_score: float, page: str, passed: Path) -> str | None:
    """None when the score reached ``min_score`` (``passed`` written), else why not."""
    doc = json.loads(evaluation.read_text())
    score, model = doc.get("score"), model_name(doc.get("model") or {})
    if score is None or score < min_score:
        said = "no score (no decision point evaluated)" if score is None else f"score {score:.4g}"
        return (
            f"eval_min_score: the model's evaluation gave {said}, below config eval.min_score "
            f"{min_score:g}: no llm sample is analysed (model {model}; see {page})"
        )
    record = {"score": score, "min_score": min_score, "model": model, "evaluation": str(evaluation)}
    passed.write_text(json.dumps(record, indent=2) + "\n")
    return None


if "snakemake" in globals():  # run by the rule; importable without it
    sm = snakemake  # noqa: F821 (given by Snakemake's script directive)
    refusal = check(
        Path(sm.input.evaluation), sm.params.min_score, sm.params.page, Path(sm.output[0])
    )
    Path(sm.log[0]).write_text((refusal or "passed") + "\n")
    if refusal:
        sys.exit(refusal)

"""A CellTypist model file, read without running what a pickle may carry.

CellTypist writes its models with pickle, and loading a pickle runs whatever callables it names:
a file that is not what it claims runs its code. So a model is read only from the file the user
named, and only through an allow-list of what CellTypist's models are made of (scikit-learn's
LogisticRegression or SGDClassifier and StandardScaler, NumPy arrays, plain containers): a
pickle naming anything else (``os.system``, ``builtins.eval``...) is refused before any of it
runs. The sha256 is of the very bytes unpickled, and a caller that knows the model's sha256
(the run's setting) has a changed file refused. What remains: the allowed classes' own
unpickling code runs, so a model is still a file to trust.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path
from typing import Any

# (module, name) a CellTypist model's pickle may name; NumPy's under both its 1.x and 2.x paths
ALLOWED = frozenset(
    {
        ("sklearn.linear_model._logistic", "LogisticRegression"),
        ("sklearn.linear_model._stochastic_gradient", "SGDClassifier"),
        ("sklearn.preprocessing._data", "StandardScaler"),
        ("sklearn._loss._loss", "CyHalfBinomialLoss"),
        ("sklearn._loss._loss", "CyHalfMultinomialLoss"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }
    | {
        (f"numpy.{core}.{module}", name)
        for core in ("core", "_core")
        for module, name in (
            ("multiarray", "_reconstruct"),
            ("multiarray", "scalar"),
            ("numeric", "_frombuffer"),
        )
    }
)
MAX_BYTES = 2 << 30  # CellTypist's largest published models are ~100 MB


class ModelRefused(Exception):
    """The file is not a CellTypist model, or not the one the run was given."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise ModelRefused(
                f"its pickle names {module}.{name}, which no CellTypist model holds (not "
                "loaded: unpickling would have run it)"
            )
        return super().find_class(module, name)


def read_model(path: Path, expected_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """What CellTypist's Model.write pickled in ``path`` (``Model``: the classifier, ``Scaler_``,
    ``description``; ``celltypist.models.Model(**...)`` of them is the model) and the sha256 of
    the bytes it was read from. ModelRefused, saying why, for a file that is not a model (or names
    anything outside ``ALLOWED``), or whose sha256 is not ``expected_sha256``; OSError when it
    cannot be read."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ModelRefused(f"{path}: {size:,} bytes, more than a CellTypist model's {MAX_BYTES:,}")
    data = path.read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise ModelRefused(
            f"{path} changed since the run began: its sha256 is {sha256}, the run's setting "
            f"says {expected_sha256} (a model is one of the run's settings: rerun with "
            "--replace-changed to analyse with the new one)"
        )
    try:
        doc = _AllowListUnpickler(io.BytesIO(data)).load()
    except ModelRefused as e:
        raise ModelRefused(f"{path} is not a CellTypist model: {e}") from None
    except Exception as e:  # whatever else the bytes are: a text file, a torn pickle
        raise ModelRefused(
            f"{path} is not a CellTypist model (expected a pickle written by celltypist.train or "
            f"Model.write): {type(e).__name__}: {e}"
        ) from None
    _check_model(doc, path)
    return doc, sha256


def _check_model(doc: Any, path: Path) -> None:
    """What Model.write pickles: a classifier with its genes (features) and labels (classes_),
    a fitted scaler and a description."""
    keys = ("Model", "Scaler_", "description")
    if not isinstance(doc, dict) or any(k not in doc for k in keys):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ModelRefused(
            f"{path} is not a CellTypist model: it holds {got}, not a mapping of {', '.join(keys)}"
        )
    clf, scaler = doc["Model"], doc["Scaler_"]
    if not (hasattr(clf, "features") and hasattr(clf, "classes_") and hasattr(scaler, "scale_")):
        raise ModelRefused(
            f"{path} holds no CellTypist classifier (its 'Model' has no features or classes_, "
            "or its 'Scaler_' no scale_)"
        )

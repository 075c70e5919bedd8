"""lossplug.contracts — the pydantic models every batch, recipe and result is checked against (the batches: each
field declared once with a TensorField, their rule tables and JSON schema derived from it).

Imports only torch and pydantic (and, lazily, yaml for recipes).
"""

from .batch import LOGP_TOLERANCE, PackedTransitions, PolicyBatch, TensorField
from .errors import BatchValidationError, LossplugError, MissingExtra, PluginError, RecipeError, Violation
from .normalizer import Normalizer
from .provenance import LogProbSource, Provenance
from .recipe import PluginSpec, Recipe
from .results import AdvantageResult, LossResult, RolloutResult

__all__ = [
    "AdvantageResult",
    "BatchValidationError",
    "LOGP_TOLERANCE",
    "LogProbSource",
    "LossResult",
    "LossplugError",
    "MissingExtra",
    "Normalizer",
    "PackedTransitions",
    "PluginError",
    "PluginSpec",
    "PolicyBatch",
    "Provenance",
    "Recipe",
    "RecipeError",
    "RolloutResult",
    "TensorField",
    "Violation",
]

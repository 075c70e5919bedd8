"""Built-in gates, one module per gate family.

Modules with a leading underscore are helpers the gates share, not gates. :func:`whole_batch_weight` (the
corrections run once over a whole rollout batch, as verl's driver computes them) is public API and is named here.
"""

from ._rollout_weights import WholeBatchCorrection, whole_batch_weight

__all__ = ["WholeBatchCorrection", "whole_batch_weight"]

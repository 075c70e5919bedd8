"""Built-in regularizers: per-token terms added to the policy loss with a coefficient (KL, entropy).

This package is the built-in regularizers' plugin module: lossplug's ``pyproject.toml`` declares it in the
``lossplug`` entry-point group, as a third-party package declares its own, and its hook registers every regularizer
the modules below define.
"""

from __future__ import annotations

from collections.abc import Callable

import lossplug


@lossplug.hookimpl
def lossplug_register_regularizers(register: Callable[[lossplug.RegularizerPlugin], None]) -> None:
    from . import distillation, echo, entropy, kl, kl_on_policy, nll

    register(kl.kl)
    register(entropy.entropy)
    register(nll.nll)
    # found missing by the field inventory (docs/field.md): NeMo-RL's KL with its score-function weight
    register(kl_on_policy.kl_on_policy)
    # found missing by the field inventory (docs/field.md): prime-rl's echo, cross-entropy on observation tokens
    register(echo.echo)
    # the Teachers and turns issue: verl's distillation loss (supervised or policy-gradient), AReaL's pure KD
    register(distillation.distillation)

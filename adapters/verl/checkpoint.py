"""The state of the estimator recipe's controllers (an adaptive KL coefficient in the reward, running statistics)
saved with verl's checkpoint and restored on resume.

verl's driver is one process, and the estimator ``lossplug`` runs there: the controllers live in the compiled
``algorithm.lossplug`` recipe of that process. verl 0.9.1's ``RayPPOTrainer._save_checkpoint`` saves the actor, the
critic and the dataloader under ``<trainer.default_local_dir>/global_step_<n>/`` — not even its own
``kl_ctrl_in_reward`` — so :class:`LossplugCheckpoints`, mixed into the trainer class, adds
:data:`CONTROLLER_FILE` beside them and reads it back in ``_load_checkpoint``::

    class Trainer(LossplugCheckpoints, RayPPOTrainer): ...

A resumed run then continues with the coefficient where the interrupted one left it. A checkpoint without the file
(saved by a plain ``RayPPOTrainer``) is refused on resume, unless ``+algorithm.lossplug_fresh_controllers=true``
asks for a fresh start of the controllers.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lossplug
from lossplug.adapters.verl.equivalent.keys import ALGORITHM_FRESH_CONTROLLERS_KEY as FRESH_KEY
from lossplug.adapters.verl.recipes import ADVANTAGE_RECIPE_KEY, load_recipe
from lossplug.contracts import LossplugError, Recipe

__all__ = [
    "CONTROLLER_FILE",
    "FRESH_KEY",
    "LossplugCheckpoints",
    "load_controllers",
    "save_controllers",
]

#: the file beside verl's ``actor/`` and ``data.pt`` in a ``global_step_<n>`` folder
CONTROLLER_FILE = "lossplug_controllers.json"


def save_controllers(step_folder: str | os.PathLike[str], recipe: Recipe) -> str | None:
    """Write the recipe's controller state into ``step_folder`` (created if needed); the file's path, or None when
    the recipe has no controller (nothing is written)."""
    state = lossplug.controller_state(recipe)
    if not state:
        return None
    os.makedirs(step_folder, exist_ok=True)
    path = os.path.join(step_folder, CONTROLLER_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(state, f)
    return path


def load_controllers(step_folder: str | os.PathLike[str], recipe: Recipe, *, fresh: bool = False) -> bool:
    """Restore the recipe's controllers from ``step_folder``; whether anything was restored. A recipe with
    controllers and a folder without :data:`CONTROLLER_FILE` is a :class:`~lossplug.LossplugError` unless
    ``fresh`` (the controllers then keep their initial state)."""
    if not lossplug.controller_state(recipe):
        return False
    path = os.path.join(step_folder, CONTROLLER_FILE)
    if not os.path.isfile(path):
        if fresh:
            return False
        raise LossplugError(
            f"resuming from {step_folder}: {ADVANTAGE_RECIPE_KEY} has controllers "
            f"({', '.join(lossplug.controller_state(recipe))}) and the checkpoint holds no {CONTROLLER_FILE}: it was "
            f"saved without lossplug's state (a trainer class without LossplugCheckpoints). Next step: resume with "
            f"the trainer that saved it with LossplugCheckpoints, or set +algorithm.{FRESH_KEY}=true to start the "
            f"controllers afresh"
        )
    with open(path, encoding="utf-8") as f:
        lossplug.load_controller_state(recipe, json.load(f))
    return True


class LossplugCheckpoints:
    """Mixin for verl's ``RayPPOTrainer`` (before it in the bases): saves and restores the controllers of the
    ``algorithm.lossplug`` recipe with verl's checkpoint (see the module docstring)."""

    config: Any
    global_steps: int

    def _lossplug_recipe(self) -> Recipe | None:
        algorithm = self.config.algorithm
        if algorithm.get("adv_estimator") != "lossplug" or algorithm.get("lossplug") is None:
            return None
        # the same content gives the same recipe object: the one whose controllers the estimator steps
        return load_recipe(algorithm.get("lossplug"), ADVANTAGE_RECIPE_KEY)

    def _save_checkpoint(self) -> None:
        super()._save_checkpoint()  # type: ignore[misc]  # (verl's trainer, after this class in the bases)
        recipe = self._lossplug_recipe()
        if recipe is not None:
            save_controllers(self._step_folder(self.config.trainer.default_local_dir), recipe)

    def _load_checkpoint(self) -> Any:
        loaded = super()._load_checkpoint()  # type: ignore[misc]  # (verl's trainer, after this class in the bases)
        recipe = self._lossplug_recipe()
        if recipe is not None and self.global_steps > 0:  # verl resumed from global_step_<global_steps>
            trainer = self.config.trainer
            folder = (
                str(trainer.resume_from_path)
                if trainer.resume_mode == "resume_path"
                else self._step_folder(trainer.default_local_dir)
            )
            load_controllers(folder, recipe, fresh=bool(self.config.algorithm.get(FRESH_KEY, False)))
        return loaded

    def _step_folder(self, root: str) -> str:
        root = root if os.path.isabs(root) else os.path.join(os.getcwd(), root)
        return os.path.join(root, f"global_step_{self.global_steps}")

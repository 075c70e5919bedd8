"""The recipe's controllers in a TRL run — adaptive regularizer coefficients, stepped at each optimizer step
(:func:`step_controllers`), and the shapers' state across steps, stepped once per generation batch where the
advantage runs (:mod:`~lossplug.adapters.trl.advantages`) — written into every checkpoint folder and restored on
resume, as TRL does with its own ``entropy_ctrl_state.json``. A checkpoint without that file, resumed by a recipe
with controllers, is refused unless the user asks for a fresh start (:data:`FRESH_CONTROLLERS_ENV`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lossplug
from lossplug.adapters.trl.state import AdapterState, adapter_state
from lossplug.contracts import LossplugError

if TYPE_CHECKING:
    from trl import GRPOTrainer

__all__ = [
    "CONTROLLER_STATE_FILE",
    "FRESH_CONTROLLERS_ENV",
    "load_controller_state",
    "save_controller_state",
    "step_controllers",
]

#: the file, in each checkpoint folder, holding the recipe's controller state (adaptive coefficients)
CONTROLLER_STATE_FILE = "lossplug_controllers.json"
#: set to 1 to resume from a checkpoint without :data:`CONTROLLER_STATE_FILE` with the controllers' initial state
FRESH_CONTROLLERS_ENV = "LOSSPLUG_TRL_FRESH_CONTROLLERS"


def step_controllers(trainer: GRPOTrainer, st: AdapterState, mode: str) -> None:
    """At an optimizer-step boundary (the window's last micro-batch, after its loss used the coefficient in force —
    TRL's order), step the recipe's controllers on the window's observations summed over processes; evaluation never
    moves a coefficient (TRL: train mode only). Logs TRL's ``entropy_coef`` for the recipe's entropy stage as TRL
    does (every optimizer step: the adaptive coefficient just updated, or the static one)."""
    if mode != "train" or not trainer.accelerator.sync_gradients:
        return
    from lossplug.control import controllers

    ctrls = controllers(st.recipe)
    accelerator = trainer.accelerator
    all_reduce = (lambda t: accelerator.reduce(t, reduction="sum")) if accelerator.num_processes > 1 else None
    for stage in lossplug.compile_recipe(st.recipe).regularizers:
        where = stage.where.removeprefix("recipe.")
        ctrl = ctrls.get(where)
        params: Any = stage.params  # (a regularizer's own model: every one has a coefficient)
        coefficient = float(ctrl.step(all_reduce)) if ctrl is not None else float(params.coef)
        if stage.plugin.name == "entropy":
            trainer._metrics[mode]["entropy_coef"].append(coefficient)


def save_controller_state(trainer: GRPOTrainer, trial: Any) -> None:
    """Write the recipe's controller state into the checkpoint folder TRL has just saved (nothing when the recipe
    has no controller)."""
    from lossplug.control import controller_state

    state = controller_state(adapter_state(trainer).recipe)
    if state and trainer.args.should_save:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(trainer._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        (folder / CONTROLLER_STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def load_controller_state(trainer: GRPOTrainer, checkpoint: Any) -> None:
    """Restore the recipe's controller state from a checkpoint folder. A recipe with controllers and a folder
    without :data:`CONTROLLER_STATE_FILE` is a :class:`~lossplug.LossplugError` (the run would go on with another
    coefficient or other statistics than the one it resumes) unless ``LOSSPLUG_TRL_FRESH_CONTROLLERS=1``."""
    if checkpoint is None:
        return
    from lossplug.control import controller_state
    from lossplug.control import load_controller_state as restore

    recipe = adapter_state(trainer).recipe
    stateful = sorted(controller_state(recipe))
    if not stateful:
        return
    path = Path(checkpoint) / CONTROLLER_STATE_FILE
    if path.is_file():
        restore(recipe, json.loads(path.read_text()))
    elif os.environ.get(FRESH_CONTROLLERS_ENV) != "1":
        raise LossplugError(
            f"resuming from {checkpoint}: the recipe's {', '.join(stateful)} keep state across steps and the "
            f"checkpoint holds no {CONTROLLER_STATE_FILE} (it was saved without lossplug's state, e.g. by a plain "
            f"GRPOTrainer). Next step: resume from a checkpoint a lossplug trainer saved with this recipe, or set "
            f"{FRESH_CONTROLLERS_ENV}=1 to start that state afresh"
        )

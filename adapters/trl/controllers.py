"""The recipe's step controllers (adaptive regularizer coefficients) in a TRL run: stepped at each optimizer step
(:func:`step_controllers`), written into every checkpoint folder and restored on resume, as TRL does with its own
``entropy_ctrl_state.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lossplug
from lossplug.adapters.trl.state import AdapterState, adapter_state

if TYPE_CHECKING:
    from trl import GRPOTrainer

__all__ = ["CONTROLLER_STATE_FILE", "load_controller_state", "save_controller_state", "step_controllers"]

#: the file, in each checkpoint folder, holding the recipe's controller state (adaptive coefficients)
CONTROLLER_STATE_FILE = "lossplug_controllers.json"


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
    """Restore the recipe's controller state from a checkpoint folder (when it has one)."""
    if checkpoint is None:
        return
    path = Path(checkpoint) / CONTROLLER_STATE_FILE
    if path.is_file():
        from lossplug.control import load_controller_state as restore

        restore(adapter_state(trainer).recipe, json.loads(path.read_text()))

"""The TRL trainer: :class:`LossplugGRPOTrainer` (a ``GRPOTrainer`` subclass) and :func:`attach` (an already-built
trainer), both running a lossplug recipe through the overrides of one mixin. This is the module that imports TRL;
:mod:`lossplug.adapters.trl` imports it on first use of either name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import torch
import trl

import lossplug
from lossplug.adapters.trl.advantages import add_recipe_advantages
from lossplug.adapters.trl.controllers import load_controller_state, save_controller_state
from lossplug.adapters.trl.equivalent import Population
from lossplug.adapters.trl.loss import compute_loss, trl_peers
from lossplug.adapters.trl.record import trl_provenance, write_record
from lossplug.adapters.trl.refusals import check_trl_version, refusals
from lossplug.adapters.trl.state import (
    AdapterState,
    RecipeLike,
    adapter_state,
    batch_stages,
    check_options,
    named_stages,
)
from lossplug.contracts import LossplugError, Provenance, Recipe
from lossplug.needs import required_fields

if TYPE_CHECKING:
    from trl import GRPOConfig

    from lossplug.pipeline import MetricLevel, Validate

    _TrainerBase = trl.GRPOTrainer  # what the mixin is combined with, for type checkers
else:
    _TrainerBase = object

__all__ = ["LossplugGRPOTrainer", "attach"]

_T = TypeVar("_T", bound="trl.GRPOTrainer")


class _Mixin(_TrainerBase):
    """The overrides; combined with ``GRPOTrainer`` (or a user's subclass of it) by :func:`attach`."""

    _lossplug: AdapterState
    if TYPE_CHECKING:  # what TRL types more loosely (TrainingArguments, an optional model)
        args: GRPOConfig
        model: Any

    # -- records --------------------------------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        st = adapter_state(self)
        if not st.record_written and self.accelerator.is_main_process:
            write_record(self)
            st.record_written = True
        return super().train(*args, **kwargs)

    # -- advantages -----------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        adapter_state(self).rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(
        self, inputs: list[dict[str, torch.Tensor | Any]]
    ) -> dict[str, torch.Tensor | Any]:
        st = adapter_state(self)
        st.rewards_per_func = None
        output = super()._generate_and_score_completions(inputs)
        rewards_per_func, st.rewards_per_func = st.rewards_per_func, None
        if rewards_per_func is None:
            raise LossplugError(
                "TRL's _generate_and_score_completions did not call _calculate_rewards: this TRL "
                "version is not supported by lossplug.adapters.trl"
            )
        add_recipe_advantages(self, output, rewards_per_func)
        return output

    # -- loss -----------------------------------------------------------------------------------------------------
    def _compute_loss(self, model: Any, inputs: Any) -> torch.Tensor:
        return compute_loss(self, model, inputs)

    # -- checkpoints: the recipe's controller state (adaptive coefficients) ----------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        save_controller_state(self, trial)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        load_controller_state(self, checkpoint)


class LossplugGRPOTrainer(_Mixin, trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose advantage and loss come from a lossplug recipe.

    ``LossplugGRPOTrainer(model, reward_funcs, args, ..., recipe="dapo", validate="full",
    population="generation", metrics="basic", provenance=None)`` — every ``GRPOTrainer`` argument, plus:

    * ``recipe``: a :class:`lossplug.Recipe`, a preset name, a mapping or a YAML/JSON path;
    * ``validate``: ``"full"`` (every batch checked against the contracts) or ``"off"``;
    * ``population``: ``"generation"`` or ``"micro_batch"`` (see :mod:`lossplug.adapters.trl`);
    * ``metrics``: ``"basic"`` (every micro-batch: the loss, ``update/approx_kl`` and each gate's cut fractions,
      at about the cost of TRL's own clip-ratio metrics), ``"full"`` (also ratio quantiles and effective-sample
      fractions: a few ms per micro-batch at 64 × 4096 on a CPU) or ``"off"``; logged as ``lossplug/<name>``;
    * ``provenance``: a :class:`lossplug.Provenance` to record instead of the one derived from the config.
    """

    def __init__(
        self,
        *args: Any,
        recipe: RecipeLike,
        validate: Validate = "full",
        population: Population = "generation",
        metrics: bool | MetricLevel = "basic",
        provenance: Provenance | None = None,
        **kwargs: Any,
    ) -> None:
        check_trl_version(trl.__version__)
        check_options(validate, population, metrics)
        recipe_obj = Recipe.load(recipe)  # a bad recipe fails before any model is loaded
        lossplug.compile_recipe(recipe_obj)
        super().__init__(*args, **kwargs)
        _setup(self, recipe_obj, validate, population, provenance, metrics)


#: ``Lossplug<base>`` for each user subclass of ``GRPOTrainer`` attached to: one class per base, so that attaching
#: again swaps to the same class
_SUBCLASSES: dict[type, type] = {}


def _class_for(base: type) -> type:
    """The lossplug subclass of ``base``: ``LossplugGRPOTrainer`` for ``GRPOTrainer`` itself, ``base`` when it is one."""
    if issubclass(base, _Mixin):
        return base
    if base is trl.GRPOTrainer:
        return LossplugGRPOTrainer
    cls = _SUBCLASSES.get(base)
    if cls is None:
        namespace = {"__module__": __name__, "__doc__": f"{base.__name__} with a lossplug recipe"}
        cls = _SUBCLASSES[base] = type(f"Lossplug{base.__name__}", (_Mixin, base), namespace)
    return cls


def attach(
    trainer: _T,
    recipe: RecipeLike,
    *,
    validate: Validate = "full",
    population: Population = "generation",
    metrics: bool | MetricLevel = "basic",
    provenance: Provenance | None = None,
) -> _T:
    """Make an already-built ``GRPOTrainer`` (or subclass) run ``recipe``; returns the same object.

    Its class is swapped for a lossplug subclass of its own class (``LossplugGRPOTrainer`` for a plain
    ``GRPOTrainer``); nothing else about it changes, except that completions TRL already buffered (attaching during
    training) are dropped so that every batch the recipe sees was scored by it. Attaching again replaces the
    recipe.
    """
    check_trl_version(trl.__version__)
    if isinstance(trainer, trl.RLOOTrainer) or not isinstance(trainer, trl.GRPOTrainer):
        _setup(trainer, recipe, validate, population, provenance, metrics)  # raises the explanatory error
    cls = _class_for(type(trainer))
    previous = trainer.__class__
    trainer.__class__ = cls
    try:
        _setup(trainer, recipe, validate, population, provenance, metrics)
    except Exception:
        trainer.__class__ = previous
        raise
    # completions already buffered (attach during training) carry advantages the recipe did not compute and no
    # group ids: have TRL generate afresh at its next step
    if getattr(trainer, "_buffered_inputs", None) is not None:
        trainer._buffered_inputs = None
    return trainer


def _check_trainer_class(trainer: Any) -> None:
    """Refuse what is not a ``GRPOTrainer`` (``RLOOTrainer`` explained) and a class that overrides ``_compute_loss``."""
    if isinstance(trainer, trl.RLOOTrainer):
        raise LossplugError(
            "RLOOTrainer is not supported: its batches carry per-sequence summed old log-probs (old_logps [B]) and a "
            "KL folded into the reward, so lossplug's token-level gates cannot run on them without forking it. Use "
            "LossplugGRPOTrainer (or attach to a GRPOTrainer) with recipe 'rloo' for a leave-one-out baseline."
        )
    if not isinstance(trainer, trl.GRPOTrainer):
        raise LossplugError(
            f"lossplug.adapters.trl supports GRPOTrainer (and its subclasses), got {type(trainer).__name__}"
        )
    owner = next(c for c in type(trainer).__mro__ if "_compute_loss" in c.__dict__ and c is not _Mixin)
    if owner is not trl.GRPOTrainer and not issubclass(owner, _Mixin):  # a user class between us and GRPOTrainer
        raise LossplugError(
            f"{owner.__name__} overrides _compute_loss: lossplug replaces _compute_loss and would "
            "silently discard that code; attach to a class that does not override it"
        )


def _setup(
    trainer: Any,
    recipe: RecipeLike,
    validate: Validate,
    population: Population,
    provenance: Provenance | None,
    metrics: bool | MetricLevel = "basic",
) -> None:
    """Check the trainer and the recipe against each other (every refusal at once) and put the adapter's state on
    the trainer."""
    check_trl_version(trl.__version__)
    level = check_options(validate, population, metrics)
    _check_trainer_class(trainer)
    recipe_obj = Recipe.load(recipe)
    compiled = lossplug.compile_recipe(recipe_obj)
    provenance = provenance if provenance is not None else trl_provenance(trainer)
    problems = refusals(trainer, compiled, provenance)
    if problems:
        raise LossplugError(
            "lossplug cannot run this recipe in this TRL trainer without changing its meaning:\n  - "
            + "\n  - ".join(problems)
        )
    top_entropy = named_stages(compiled.gates, "top_entropy")
    trainer._lossplug = AdapterState(
        recipe=recipe_obj,
        compiled=compiled,
        validate=validate,
        population=population,
        provenance=provenance,
        metrics=level,
        kl_sequence_level=compiled.update.plugin.level == "sequence",
        needs=frozenset(f for stage in batch_stages(compiled) for f in required_fields(stage.plugin, stage.params)),
        recipe_kl=bool(named_stages(compiled.regularizers, "kl")),
        recipe_entropy=bool(named_stages(compiled.regularizers, "entropy")),
        top_entropy_quantile=top_entropy[0].params.quantile if top_entropy else None,
        trl_class=next(c for c in type(trainer).__mro__ if not issubclass(c, _Mixin)).__name__,
        peers=trl_peers(trainer),
    )

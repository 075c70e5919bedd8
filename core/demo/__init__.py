"""``lossplug demo``: train a tiny model from scratch with TRL's ``GRPOTrainer`` and a lossplug recipe, on CPU, with
no hub access — and show that it learns.

The task (:class:`SuccessorTask`) is verifiable and small enough for a randomly initialised 2-layer model to learn
in seconds of CPU: a prompt is one to three filler letters followed by a digit ``d`` (``"c k 7"``); the reward is 1
when the first word of the completion is ``(d + 1) mod 10`` and 0 otherwise. An untrained model spreads its mass
over the 54-word vocabulary, so the reward starts near 0.02–0.03; with the default settings it passes 0.8 within
about 100 steps.

Held-out ability is measured apart from the learning signal (a rising reward alone proves no ability): greedy
decoding on prompts whose filler letters (``n``–``z``) never occur in training (``a``–``m``), scored with the same
reward, before training, every ``eval_every`` steps and at the end.

Settings (:data:`DEFAULT`; :data:`FAST` is the same for 60 steps): 16 prompts × 16 completions of at most 3 tokens
per rollout batch, two optimizer steps per batch (the second is off-policy, so update ratios and clip fractions are
not trivially 1 and 0), Adam at a constant 3e-3, a 2-layer hidden-64 Qwen2 (:mod:`lossplug.testing.tiny`), 200
steps, one torch thread (for a model this small one thread was about 5× faster than two on a 2-core machine:
torch's worker threads spin).

A run folder holds::

    recipe.yaml       the resolved recipe, defaults filled          (written by lossplug.adapters.trl)
    provenance.json   behaviour / old / current / reference log-prob sources
    versions.json     python, torch, trl, transformers, lossplug … and the TRL settings the recipe replaced
    metrics.jsonl     one line per logging step: TRL's metrics, lossplug/… metrics, demo/… throughput, heldout/…
    summary.json      reward and held-out score before/after, wall and CPU time, the recipe's gates, settings, task
    curves.png        learning signal, gate activity, throughput and held-out score on separate panels

The modules: :mod:`~lossplug.demo.settings`, :mod:`~lossplug.demo.task` (task, reward, held-out evaluation),
:mod:`~lossplug.demo.training` (:func:`run_demo`: trainer, callback, one run), :mod:`~lossplug.demo.display` (the
live panel), :mod:`~lossplug.demo.gate_metrics` (which metrics are the gates' fractions),
:mod:`~lossplug.demo.figures` (``curves.png``, ``compare.png``), :mod:`~lossplug.demo.record` (run folder, summary)
and :mod:`~lossplug.demo.compare` (:func:`run_compare`: several recipes on the same seeds).

The demo sits on top of the TRL adapter — the one part of ``lossplug`` that imports ``lossplug.adapters`` — and
imports TRL, transformers and torch only inside its functions: ``import lossplug.demo`` costs nothing, and
``import lossplug`` never imports it.
"""

from __future__ import annotations

from .compare import run_compare
from .figures import compare_figure, plot_compare, plot_run, run_figure
from .gate_metrics import GateFraction, gate_fractions
from .record import RunResult, default_out_dir, recipe_label
from .settings import DEFAULT, DEFAULT_RECIPE, FAST, LEARNED_MARGIN, DemoSettings
from .task import HELDOUT_FILLERS, TRAIN_FILLERS, SuccessorTask, score, successor_reward
from .training import run_demo

__all__ = [
    "DEFAULT",
    "DEFAULT_RECIPE",
    "FAST",
    "HELDOUT_FILLERS",
    "LEARNED_MARGIN",
    "TRAIN_FILLERS",
    "DemoSettings",
    "GateFraction",
    "RunResult",
    "SuccessorTask",
    "compare_figure",
    "default_out_dir",
    "gate_fractions",
    "plot_compare",
    "plot_run",
    "recipe_label",
    "run_compare",
    "run_demo",
    "run_figure",
    "score",
    "successor_reward",
]

"""lossplug.tools — the rest of an RLHF/PPO step's algorithms, as plain functions you call yourself.

Not plugins: nothing here is registered, named in a recipe or dispatched by the pipeline. Each module is a set of
validated, tested functions and small classes (each module cites its paper and reference code), for the parts of an
RL step that live outside the policy loss — call them from your own training loop (or an adapter) where you need them:

* :mod:`lossplug.tools.kl` — the k1/k2/k3 KL estimators, verl's ``kl_penalty`` modes, KL-shaped rewards and the KL
  coefficient controllers (PPO-Penalty's adaptive one, verl's/TRL's proportional one, a fixed one);
* :mod:`lossplug.tools.value_loss` — PPO's clipped value loss and its clip fraction;
* :mod:`lossplug.tools.diagnostics` — the PPO-epoch statistics (approx/policy KL, clip fractions, entropy, masked
  mean/variance) and the ratio guard;
* :mod:`lossplug.tools.reward_model` — the pairwise (Bradley–Terry) reward-model loss on the last non-padding token;
* :mod:`lossplug.tools.dynamic_sampling` — DAPO's mixed-group filter with its full generation-cost report.

They depend only on :mod:`lossplug.contracts` and core helpers such as :mod:`lossplug.ops`, never on
:mod:`lossplug.plugins` — plugins may use them (``gae``'s ``kl_coef`` shapes rewards with
:func:`lossplug.tools.kl.kl_shaped_rewards`), not the other way round. Importing this package imports none of its
modules: import the one you use.
"""

"""verl configuration → lossplug recipe (:func:`verl_equivalent`): one module per side of the configuration.

* :mod:`.policy_losses` — ``actor.policy_loss.loss_mode`` (and the parameters each mode reads) → the gates;
* :mod:`.advantages` — ``algorithm.adv_estimator`` (with its options) → the advantage stage;
* :mod:`.rollout_correction` — ``algorithm.rollout_correction`` → correction gates.

Every function takes plain mappings (an ``OmegaConf`` node converted with ``to_container``) and raises
:class:`~lossplug.LossplugError` naming the setting for anything without an exact equivalent — never a silent
approximation.
"""

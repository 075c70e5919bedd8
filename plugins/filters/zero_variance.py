"""Zero-variance groups leave the batch: a prompt group whose responses all got the same reward has no group-relative
signal (every advantage is 0) yet counts in the token and sequence denominators; dropping it makes the remaining
groups' tokens weigh what they would in a batch of informative groups only — DAPO's dynamic sampling rule (Yu et
al. 2025, arXiv:2503.14476, §3.2)::

    keep group g  ⇔  std_{i ∈ g}(score_i) > 0   or   |g| = 1

with ``score_i`` the response's reward (a per-token reward summed over the response, as verl's ``filter_groups``
takes ``token_level_rewards.sum(-1)``). A group of one response is kept, as verl keeps it (``len(metric_vals) ==
1``); ``drop_singletons: true`` drops those too. Only the responses still in play count (an earlier filter's
drops are not part of the group). Filtering equals dropping the rows before verl's advantage and loss, under
``token-mean`` and ``seq-mean-token-mean`` (``tests/plugins/filters/test_zero_variance.py``), provided the step's
population counts only the responses left.

One difference: "all equal" is tested exactly (the group's largest reward equals its smallest). verl tests
``np.std(scores) > 0``, which rounding can make true for equal rewards whose floating-point mean is not exactly
their value — three rewards of 0.1 have ``np.std`` ≈ 1.4e-17 — and then keeps a group whose advantages are rounding
noise; the filter drops it.

Reference: verl 0.9.1 ``verl/trainer/ppo/v1/replay_buffer.py`` ``ReplayBuffer._dapo_filtered_keys`` (a group is
evicted iff ``len(values) > 1 and np.std(values) == 0``, ``values`` each response's summed ``rm_scores``) and the
DAPO recipe's ``RayDAPOTrainer.fit`` (``algorithm.filter_groups``: ``np.std(metric_vals) > 0 or
len(metric_vals) == 1``; github.com/verl-project/verl-recipe ``dapo/dapo_ray_trainer.py`` at commit dd811fe49f89,
formerly volcengine/verl ``recipe/dapo/dapo_ray_trainer.py`` at 53971be5b682); ROLL ``dynamic_sampling`` with
``query_filter_config.type: mean_filter``. It runs :func:`lossplug.tools.dynamic_sampling.mixed_group_rows`
(``keep_mixed_groups``' rule without its cost report).
"""

from __future__ import annotations

import torch
from pydantic import Field

import lossplug
from lossplug.tools.dynamic_sampling import mixed_group_rows

Tensor = torch.Tensor


class ZeroVarianceParams(lossplug.Params):
    drop_singletons: bool = Field(
        False, description="also drop groups with a single response in play (verl keeps them)"
    )


@lossplug.filter("zero_variance", params=ZeroVarianceParams, requires=("group_id",))
def zero_variance(inp: lossplug.RolloutInput, p: ZeroVarianceParams) -> lossplug.FilterOutput:
    """Drop the prompt groups whose rewards are all equal (DAPO's dynamic sampling rule, as verl's filter_groups)."""
    batch = inp.batch
    assert batch.reward is not None and batch.group_id is not None
    score = inp.response_reward
    rows = inp.rows
    keep = torch.zeros_like(rows)
    if bool(rows.any()):
        ids = batch.group_id[rows]
        mixed = mixed_group_rows(score[rows].to(torch.float64), ids)
        if not p.drop_singletons:
            _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            mixed = mixed | (counts[inverse] == 1)
        keep[rows] = mixed
    return lossplug.FilterOutput(keep=keep)

"""The ``kl_in_reward`` shaper against verl 0.9.1's own ``apply_kl_penalty``, run on a real ``verl.DataProto`` with
``core_algos.FixedKLController`` / ``AdaptiveKLController``, over three consecutive steps (a different batch each
step), for every estimator verl's ``kl_penalty`` accepts:

* the shaped reward (``estimate_advantages(...).reward``) is verl's ``token_level_rewards``;
* β (``controller_state(recipe)['shapers[0]']['value']``) is verl's ``kl_ctrl.value`` after each step;
* the metric ``shaper/kl_in_reward/kl`` is verl's ``actor/reward_kl_penalty``.

The score reaches verl as its reward managers place it: ``RewardManagerBase.assemble_rm_scores`` (verl's own code)
puts each response's score at ``valid_response_length − 1`` of the attention mask, as ``token_level_scores``. Our
batch gives the same score as a ``[B]`` reward (the shaper puts it on the last action token) and as that ``[B, T]``
token reward; the batches have rows of different lengths, a response with masked tokens inside it (a multi-turn
tool reply), a last response column no row reaches, and come in two layouts: verl's response columns only, and
prompt + response columns (the prompt columns masked, garbage log-probs there).

verl's ``response_mask`` is an int64 slice of the attention mask (``compute_response_mask``), as in the trainer: its
``masked_mean`` adds 1e-8 to an int64 count, which gives a float32 count where the 1e-8 is lost — so verl's per-response
mean divides by the exact token count, as ours does.

Measured by this file's comparisons (CPU, torch 2.13), every estimator, controller and step: the rewards are bit-identical to verl's in float64
and float32, in both layouts; β and the metric are bit-identical in float64, and in float32 in verl's layout. In
float32 with the prompt's columns in front, each response's KL is a float32 sum over more columns (a different
summation order), so the metric differs from verl's by ≤ 1.1e-7 relative and the adaptive β by ≤ 1.5e-8 — rounding,
within ``METRIC_RTOL_FLOAT32`` and ``BETA_RTOL_FLOAT32``.

Also here: a resumed run equals an uninterrupted one, data parallelism (two ranks each holding half the batch) gives
the single process's β, and bad input is named.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import lossplug
from lossplug import LossplugError, PluginError, PolicyBatch, Recipe
from lossplug.tools.kl import KL_PENALTY_MODES

pytest.importorskip("verl")

from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import apply_kl_penalty

#: every mode verl 0.9.1's core_algos.kl_penalty accepts ("full" raises NotImplementedError there)
ESTIMATORS = list(KL_PENALTY_MODES)
STEPS = 3
B, PROMPT, RESPONSE = 6, 3, 7
COEF = 0.05
HORIZON = 40.0  # B / HORIZON = 0.15: β moves by up to 3 % a step
#: float32, prompt + response columns only (everything else is bit-identical); measured ≤ 1.1e-7 and ≤ 1.5e-8
METRIC_RTOL_FLOAT32 = 1e-6
BETA_RTOL_FLOAT32 = 1e-7
#: β of two ranks against one process's, float64: measured ≤ 1.5e-16 (the KL summed over ranks rounds apart)
DP_BETA_RTOL = 1e-14


@dataclass(frozen=True)
class Rollout:
    """One step's batch, in verl's tensors (response columns only); ``lossplug_batch`` lays it out for us."""

    prompts: torch.Tensor  # [B, PROMPT] token ids (left-padded)
    responses: torch.Tensor  # [B, RESPONSE] token ids (right-padded)
    attention_mask: torch.Tensor  # [B, PROMPT + RESPONSE] int64
    response_mask: torch.Tensor  # [B, RESPONSE] int64: the attention mask's response part, less a tool reply
    old_logp: torch.Tensor  # [B, RESPONSE] float64
    ref_logp: torch.Tensor  # [B, RESPONSE] float64
    scores: torch.Tensor  # [B] float32 (a reward manager's scores are float32)


def rollout(step: int) -> Rollout:
    g = torch.Generator().manual_seed(100 + step)
    prompt_lengths = torch.randint(1, PROMPT + 1, (B,), generator=g)
    # every row stops before the last column: that column is masked in every row
    response_lengths = torch.randint(1, RESPONSE, (B,), generator=g)
    response_lengths[0] = RESPONSE - 1  # the longest
    response_lengths[1] = 1  # a response of one token
    columns = torch.arange(PROMPT + RESPONSE)
    prompt_part = columns[:PROMPT] >= PROMPT - prompt_lengths.unsqueeze(-1)
    response_part = columns[:RESPONSE] < response_lengths.unsqueeze(-1)
    attention_mask = torch.cat([prompt_part, response_part], dim=-1).long()
    response_mask = response_part.clone()
    response_mask[0, 2:4] = False  # a tool reply inside row 0's response (multi-turn): attended, not an action
    old = -(0.05 + 2.0 * torch.rand(B, RESPONSE, generator=g, dtype=torch.float64))
    ref = (old - 0.3 + 0.3 * torch.randn(B, RESPONSE, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    if step == 2:  # log-ratios ref − old of ±25 and 3: verl's clamps of low_var_kl (±20 on δ, 10 on the estimate)
        old[2, 0], ref[2, 0] = -25.5, -0.5
        old[3, 0], ref[3, 0] = -0.5, -25.5
        old[4, 0], ref[4, 0] = -3.2, -0.2
    return Rollout(
        prompts=torch.randint(10, 100, (B, PROMPT), generator=g),
        responses=torch.randint(10, 100, (B, RESPONSE), generator=g),
        attention_mask=attention_mask,
        response_mask=response_mask.long(),
        old_logp=old,
        ref_logp=ref,
        scores=torch.randn(B, generator=g, dtype=torch.float32),
    )


def verl_token_scores(r: Rollout) -> torch.Tensor:
    """verl's ``token_level_scores``: its reward loop's own placement of each response's score (float32)."""
    data = DataProto.from_dict(
        tensors={"prompts": r.prompts, "responses": r.responses, "attention_mask": r.attention_mask}
    )
    return RewardManagerBase.assemble_rm_scores(data, r.scores.tolist())


def verl_step(r: Rollout, kl_ctrl: Any, estimator: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, Any]]:
    data = DataProto.from_dict(
        tensors={
            "token_level_scores": verl_token_scores(r).to(dtype),
            "old_log_probs": r.old_logp.to(dtype),
            "ref_log_prob": r.ref_logp.to(dtype),
            "response_mask": r.response_mask,
        }
    )
    data, metrics = apply_kl_penalty(data, kl_ctrl, kl_penalty=estimator)
    return data.batch["token_level_rewards"], metrics


def lossplug_batch(r: Rollout, dtype: torch.dtype, *, reward: str, layout: str) -> PolicyBatch:
    """``reward``: "score" ([B], as TRL's reward functions give it) or "token" ([B, T], verl's placement);
    ``layout``: "response" (verl's columns) or "prompt_response" (the prompt's columns first, masked)."""
    old, ref, mask = r.old_logp.to(dtype), r.ref_logp.to(dtype), r.response_mask.bool()
    token_reward = verl_token_scores(r).to(dtype)
    if layout == "prompt_response":
        garbage = torch.full((B, PROMPT), -7.0, dtype=dtype)  # the prompt's log-probs: anything, masked
        old, ref = torch.cat([garbage, old], -1), torch.cat([garbage, ref], -1)
        mask = torch.cat([torch.zeros(B, PROMPT, dtype=torch.bool), mask], -1)
        token_reward = torch.cat([torch.zeros(B, PROMPT, dtype=dtype), token_reward], -1)
    return PolicyBatch(
        logp=old.clone(),
        old_logp=old,
        ref_logp=ref,
        action_mask=mask,
        reward=r.scores.to(dtype) if reward == "score" else token_reward,
    )


def response_columns(reward: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "prompt_response":
        assert torch.equal(reward[:, :PROMPT], torch.zeros_like(reward[:, :PROMPT])), "a prompt column got a reward"
        return reward[:, PROMPT:]
    return reward


def target_kl(estimator: str) -> float:
    """Just above the first batch's KL (verl's measure): the controller's error is inside its ±0.2 clip at first,
    where the arithmetic is most exposed, then the batches' KL grows and the clip takes over."""
    r = rollout(0)
    kld = core_algos.kl_penalty(r.old_logp, r.ref_logp, estimator) * r.response_mask
    return 1.1 * abs(float((kld.sum(-1) / r.response_mask.sum(-1)).mean()))


def kl_settings(estimator: str, controller: str) -> tuple[dict[str, Any], Any]:
    """The shaper's recipe entry and verl's controller for the same settings (verl's algorithm.kl_ctrl)."""
    if controller == "fixed":
        return {"name": "kl_in_reward", "estimator": estimator, "coef": COEF}, core_algos.FixedKLController(COEF)
    target = target_kl(estimator)
    entry = {
        "name": "kl_in_reward",
        "estimator": estimator,
        "coef": COEF,
        "controller": "adaptive",
        "target_kl": target,
        "horizon": HORIZON,
    }
    return entry, core_algos.AdaptiveKLController(COEF, target, HORIZON)


def kl_recipe(entry: dict[str, Any]) -> Recipe:
    return Recipe.load(
        {"gates": ["ppo_clip"], "reduction": "token", "advantage": "reinforce_plus_plus", "shapers": [entry]}
    )


def beta(recipe: Recipe) -> float:
    return lossplug.controller_state(recipe)["shapers[0]"]["value"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("controller", ["fixed", "adaptive"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_three_steps_equal_verls_apply_kl_penalty(estimator, controller, dtype):
    entry, _ = kl_settings(estimator, controller)
    variants = [(reward, layout) for reward in ("score", "token") for layout in ("response", "prompt_response")]
    recipes = {variant: kl_recipe(entry) for variant in variants}
    _, kl_ctrl = kl_settings(estimator, controller)
    for step in range(STEPS):
        r = rollout(step)
        expected, verl_metrics = verl_step(r, kl_ctrl, estimator, dtype)
        for (reward, layout), recipe in recipes.items():
            where = f"step {step}, {reward} reward, {layout} layout"
            result = lossplug.estimate_advantages(lossplug_batch(r, dtype, reward=reward, layout=layout), recipe)
            assert result.reward is not None and result.reward.dtype == dtype
            assert torch.equal(response_columns(result.reward, layout), expected), where
            rounding = dtype == torch.float32 and layout == "prompt_response"
            metric = float(result.metric_tensors["shaper/kl_in_reward/kl"])
            want = verl_metrics["actor/reward_kl_penalty"]
            assert metric == pytest.approx(want, rel=METRIC_RTOL_FLOAT32 if rounding else 0.0, abs=0.0), where
            assert beta(recipe) == pytest.approx(kl_ctrl.value, rel=BETA_RTOL_FLOAT32 if rounding else 0.0, abs=0.0), (
                where
            )
    if controller == "adaptive":
        assert kl_ctrl.value != COEF  # (the controller moved: the comparison of β says something)


def test_the_score_goes_where_verls_reward_loop_puts_it():
    """The [B] score is placed on the last action token, verl's ``valid_response_length − 1`` — also for a response
    with a tool reply inside it (row 0) and a response of one token (row 1)."""
    r = rollout(0)
    recipe = kl_recipe({"name": "kl_in_reward", "coef": 0.0})
    shaped = lossplug.estimate_advantages(lossplug_batch(r, torch.float64, reward="score", layout="response"), recipe)
    assert shaped.reward is not None
    assert torch.equal(shaped.reward, verl_token_scores(r).double())
    assert not bool(r.response_mask[0, 2:4].any()) and r.response_mask[1].sum() == 1


# ---------------------------------------------------------------------------------------------------------------------
# Resume


def run_steps(recipe: Recipe, steps: range) -> list[torch.Tensor]:
    return [
        lossplug.estimate_advantages(
            lossplug_batch(rollout(step), torch.float64, reward="score", layout="response"), recipe
        ).reward
        for step in steps
    ]


@pytest.mark.parametrize("estimator", ["k1", "low_var_kl"])
def test_a_resumed_run_equals_an_uninterrupted_one(estimator, tmp_path):
    entry, _ = kl_settings(estimator, "adaptive")
    uninterrupted = kl_recipe(entry)
    rewards = run_steps(uninterrupted, range(STEPS))

    first = kl_recipe(entry)
    resumed_rewards = run_steps(first, range(1))
    checkpoint = tmp_path / "controllers.json"
    checkpoint.write_text(json.dumps(lossplug.controller_state(first)))
    resumed = kl_recipe(entry)
    assert beta(resumed) == COEF  # a new recipe object: a fresh controller until the checkpoint is loaded
    lossplug.load_controller_state(resumed, json.loads(checkpoint.read_text()))
    assert beta(resumed) == beta(first) != COEF
    resumed_rewards += run_steps(resumed, range(1, STEPS))

    assert beta(resumed) == beta(uninterrupted)
    for step, (got, want) in enumerate(zip(resumed_rewards, rewards)):
        assert torch.equal(got, want), f"step {step}"


def two_kl_shapers() -> Recipe:
    return Recipe.load(
        {
            "gates": ["ppo_clip"],
            "reduction": "token",
            "advantage": "reinforce_plus_plus",
            "shapers": [kl_settings("k3", "adaptive")[0], kl_settings("k1", "adaptive")[0]],
        }
    )


def test_a_checkpoint_without_the_shapers_state_is_refused_naming_the_stage():
    recipe = kl_recipe(kl_settings("k3", "adaptive")[0])
    with pytest.raises(LossplugError, match=r"no state for shapers\[0\] \(kl_in_reward\).*afresh on purpose"):
        lossplug.load_controller_state(recipe, {})
    with pytest.raises(LossplugError, match=r"no adaptive stage shapers\[1\]"):
        lossplug.load_controller_state(recipe, {"shapers[0]": {"value": 0.2}, "shapers[1]": {"value": 0.2}})
    assert beta(recipe) == COEF  # nothing loaded


def test_a_fresh_start_of_a_stage_is_asked_for_explicitly():
    saved = {"shapers[0]": {"value": 0.2}}  # by a run whose recipe had only the first shaper
    recipe = two_kl_shapers()
    with pytest.raises(LossplugError, match=r"no state for shapers\[1\] \(kl_in_reward\)"):
        lossplug.load_controller_state(recipe, saved)
    lossplug.load_controller_state(recipe, {**lossplug.controller_state(recipe), **saved})  # what the message says
    assert lossplug.controller_state(recipe) == {"shapers[0]": {"value": 0.2}, "shapers[1]": {"value": COEF}}


@pytest.mark.parametrize(
    ("saved", "reason"),
    [
        ({"entropy_coef": 0.1}, r"missing key 'value'"),
        ({"value": "abc"}, r"'value' \(β\) must be a finite number > 0, got 'abc'"),
        ({"value": math.nan}, r"got nan"),
        ({"value": 0.0}, r"> 0, got 0.0"),
        (0.2, r"not subscriptable"),
    ],
)
def test_a_shapers_state_it_cannot_take_is_refused_naming_the_stage(saved, reason):
    recipe = kl_recipe(kl_settings("k3", "adaptive")[0])
    with pytest.raises(LossplugError, match=rf"shapers\[0\] \(kl_in_reward\): .*does not fit.*{reason}"):
        lossplug.load_controller_state(recipe, {"shapers[0]": saved})
    assert beta(recipe) == COEF


def test_a_checkpoint_that_fails_on_one_stage_loads_none():
    recipe = two_kl_shapers()
    with pytest.raises(LossplugError, match=r"shapers\[1\] \(kl_in_reward\)"):
        lossplug.load_controller_state(recipe, {"shapers[0]": {"value": 0.5}, "shapers[1]": {"value": -1.0}})
    assert lossplug.controller_state(recipe) == {"shapers[0]": {"value": COEF}, "shapers[1]": {"value": COEF}}


# ---------------------------------------------------------------------------------------------------------------------
# Data parallel


class FakeAllReduce:
    """The collectives of ``size`` ranks run as threads: each rank's tensor is summed (or concatenated) with the
    others' once every rank has called — what ``torch.distributed.all_reduce`` / ``all_gather`` do."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)  # a rank that fails breaks it: the others raise, no hang
        self.slots: list[torch.Tensor | None] = [None] * size

    def peers(self, rank: int) -> lossplug.Peers:
        return lossplug.Peers(
            size=self.size,
            all_gather=lambda t: torch.cat(self._exchange(rank, t)),
            all_sum=lambda t: torch.stack(self._exchange(rank, t)).sum(0),
        )

    def _exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        everyone = [t for t in self.slots if t is not None]
        self.barrier.wait()  # everyone has read before a later call overwrites the slots
        return everyone


@pytest.mark.parametrize("estimator", ["k1", "k3", "abs"])
def test_two_ranks_each_with_half_the_batch_keep_the_whole_batchs_beta(estimator):
    """verl's driver shapes the whole batch; here each rank holds half of it (``estimate_advantages`` with the
    peers' sum): β after every step is the single process's and verl's, and the halves' rewards are the whole's."""
    entry, kl_ctrl = kl_settings(estimator, "adaptive")
    whole = kl_recipe(entry)
    ranks = [kl_recipe(entry) for _ in range(2)]
    halves = [slice(0, B // 2), slice(B // 2, B)]
    for step in range(STEPS):
        r = rollout(step)
        batch = lossplug_batch(r, torch.float64, reward="score", layout="response")
        expected = lossplug.estimate_advantages(batch, whole).reward
        verl_step(r, kl_ctrl, estimator, torch.float64)

        network = FakeAllReduce(2)
        results: list[Any] = [None, None]

        def run(rank: int, network: FakeAllReduce = network, batch: PolicyBatch = batch, results=results) -> None:
            half = PolicyBatch.unchecked(**{name: t[halves[rank]] for name, t in batch.fields().items()})
            try:
                results[rank] = lossplug.estimate_advantages(half, ranks[rank], peers=network.peers(rank))
            except BaseException as err:  # (handed to the test's thread, which raises it)
                results[rank] = err

        threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        assert all(res is not None for res in results), "a rank hung"
        # (the same β, up to its rounding after step 0: the same rewards up to that rounding)
        torch.testing.assert_close(torch.cat([res.reward for res in results]), expected, rtol=DP_BETA_RTOL, atol=1e-15)
        assert beta(whole) == kl_ctrl.value, f"step {step}"
        for rank in ranks:  # (Σ over ranks of n·d, then ÷ n: the KL rounds apart from the whole batch's d)
            assert beta(rank) == pytest.approx(beta(whole), rel=DP_BETA_RTOL, abs=0.0), f"step {step}"


# ---------------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture
def register_shapers(fresh_registry):
    """``register_shapers(*shapers)`` registers shaper plugins in-process until the test ends."""
    plugins = []

    def register(*shapers: lossplug.ShaperPlugin) -> None:
        class Plugin:
            @staticmethod
            @lossplug.hookimpl
            def lossplug_register_shapers(register):
                for shaper in shapers:
                    register(shaper)

        lossplug.register_plugin(Plugin, name=f"test-shapers-{len(plugins)}")
        plugins.append(Plugin)

    yield register
    for plugin in plugins:
        lossplug.unregister_plugin(plugin)


@pytest.mark.parametrize(
    ("reward", "bad", "named"),
    [
        ("score", (3,), r"reward: must be finite — row \[3\]"),
        ("token", (0, 5), r"reward: must be finite on action positions — \(row 0, pos 5\)"),
    ],
)
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_reward_is_named_before_any_shaping(reward, bad, named, value, register_shapers):
    calls = []

    @lossplug.shaper("spy")
    def spy(inp: lossplug.RolloutInput, p: Any) -> torch.Tensor:
        calls.append(1)
        return inp.batch.reward

    register_shapers(spy)
    good = lossplug_batch(rollout(0), torch.float64, reward=reward, layout="response")
    broken = good.reward.clone()
    broken[bad] = value
    batch = PolicyBatch.unchecked(**{**good.fields(), "reward": broken})
    recipe = Recipe.load(
        {
            "gates": ["ppo_clip"],
            "reduction": "token",
            "advantage": "reinforce_plus_plus",
            "shapers": ["spy", {"name": "kl_in_reward", "coef": 0.1}],
        }
    )
    with pytest.raises(lossplug.BatchValidationError, match=named):
        lossplug.estimate_advantages(batch, recipe, validate="full")
    assert calls == [], "a shaper ran on a non-finite reward"


@pytest.mark.parametrize("per_token", [False, True], ids=["score", "token"])
def test_a_shaper_whose_reward_is_not_finite_is_a_plugin_error_naming_it(per_token, register_shapers):
    """After a [B] reward (row 1 → inf) and after kl_in_reward made it [B, T] (row 1's one action token → NaN)."""

    @lossplug.shaper("overflowing")
    def overflowing(inp: lossplug.RolloutInput, p: Any) -> torch.Tensor:
        out = inp.batch.reward.clone()
        if out.ndim == 1:
            out[1] = math.inf
        else:
            out[1, 0] = math.nan
        return out

    register_shapers(overflowing)
    before = [{"name": "kl_in_reward", "coef": 0.1}] if per_token else []
    recipe = Recipe.load(
        {
            "gates": ["ppo_clip"],
            "reduction": "token",
            "advantage": "reinforce_plus_plus",
            "shapers": [*before, "overflowing"],
        }
    )
    batch = lossplug_batch(rollout(0), torch.float64, reward="score", layout="response")
    where = r"\(row 1, pos 0\)" if per_token else r"row \[1\]"
    stage = len(before)
    with pytest.raises(PluginError, match=rf"recipe\.shapers\[{stage}\] \(overflowing\).* not finite.*{where}"):
        lossplug.estimate_advantages(batch, recipe, validate="full")


def test_every_estimator_verl_accepts_is_a_setting():
    """verl's ``algorithm.kl_penalty`` takes mse+ and k2+ too (their value and gradient are k2's)."""
    for estimator in ESTIMATORS:
        kl_recipe({"name": "kl_in_reward", "estimator": estimator})

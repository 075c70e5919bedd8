"""verl ``actor.policy_loss.loss_mode`` → lossplug gates.

Interface (used by :func:`lossplug.adapters.verl.equivalent.verl_equivalent`)::

    policy_gates(actor: Mapping[str, Any]) -> PolicyStages

``actor`` is verl's actor config as a plain dict (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
``clip_ratio_c``, ``loss_agg_mode``, ``policy_loss: {loss_mode, clip_cov_*, kl_cov_*, ppo_kl_coef, ...}``, ...).
A key that is absent takes verl 0.9.1's default (``ActorConfig`` / ``PolicyLossConfig``).

Every one of verl 0.9.1's twelve registered losses (``core_algos.POLICY_LOSS_REGISTRY``)::

    vanilla      ppo_clip(eps_low, eps_high, dual_clip_c = clip_ratio_c)          (verl always dual-clips)
    gspo         gspo_token(eps_low, eps_high)                                    (verl implements GSPO-token)
    sapo         sapo(tau_pos, tau_neg)                   + reduction response    (ignores loss_agg_mode)
    cispo        cispo(eps_low, eps_high)
    gpg          reinforce                                                        (−A·logp, identical)
    dppo_tv      dppo_tv(eps_low, eps_high, ratio_cap = clip_ratio_c)
    dppo_kl      dppo_kl(eps_low, eps_high, ratio_cap = clip_ratio_c)
    clip_cov     clip_cov(eps_low, eps_high, ratio, lb, ub)                       (random: verl's RNG replayed)
    kl_cov       kl_cov(ratio, coef = ppo_kl_coef)
    geo_mean     gmpo(eps_low, eps_high)                  + reduction response    (ignores loss_agg_mode;
                                                            population micro_batch: verl's batch-local mean)
    dro          dro(beta = dro_beta)                                             (dro_beta is required)
    bypass_mode  loss_type=reinforce: reinforce, bypass_is|bypass_is_seq, bypass_rs
                 loss_type=ppo_clip:  ppo_clip (as vanilla), bypass_rs            (IS weights: verl's metrics only)

``eps_low``/``eps_high`` are ``clip_ratio_low``/``clip_ratio_high`` (each falling back to ``clip_ratio``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lossplug.adapters.verl.equivalent.settings import ACTOR_DEFAULTS
from lossplug.contracts import LossplugError
from lossplug.plugins.gates.rollout_rejection import parse_options, parse_thresholds

#: verl 0.9.1's PolicyLossConfig defaults: the package's ACTOR_DEFAULTS table (ActorConfig's) holds them
POLICY_LOSS_DEFAULTS: dict[str, Any] = ACTOR_DEFAULTS["policy_loss"]
ROLLOUT_CORRECTION_DEFAULTS: dict[str, Any] = {
    "rollout_is": "sequence",
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "loss_type": "ppo_clip",
}
#: notes for the losses whose verl function is batch-local or ignores loss_agg_mode (text for docs/verl.md)
GEO_MEAN_NOTE = (
    "geo_mean: verl returns torch.mean over the rows of each micro-batch and ignores loss_agg_mode and "
    "global_batch_info (no x dp_size); its engine adds the micro-batches' losses as they are and averages the ranks: "
    "recipe gmpo + reduction {name: response, population: micro_batch} reproduces it exactly (the verl adapter hands "
    "a micro-batch-local reduction its own micro-batch as population, no x dp_size), whatever the micro-batches, "
    "dynamic batch size and dp_size. It depends on the split (the step's loss grows with the micro-batches per rank); "
    "the data-parallel-exact alternative is gmpo + reduction response over the step's population: the mean over "
    "all responses of the step, whatever the split (docs/verl.md, 'geo_mean under data parallelism'). verl averages "
    "rollout_is_weights geometrically per response for geo_mean; lossplug's adapter multiplies them per token: with "
    "algorithm.rollout_correction.rollout_is set, not exact."
)
SAPO_NOTE = "sapo: verl always aggregates with seq-mean-token-mean (reduction response), whatever loss_agg_mode says."
COVARIANCE_NOTE = (
    "{mode}: the covariance statistics and the token selection are per micro-batch (as in verl), so they depend on "
    "how the step is split; the aggregation follows loss_agg_mode and global_batch_info exactly."
)
CLIP_COV_RNG_NOTE = (
    "clip_cov: the random choice replays verl's torch.randperm on the default CPU generator: identical selection for "
    "the same RNG state at the call (the generator is then advanced by max(floor(clip_cov_ratio*B*T), 1) words, "
    "verl's by candidates-1)."
)
BYPASS_NOTE = (
    "bypass_mode: verl forces loss_mode=bypass_mode whenever algorithm.rollout_correction.bypass_mode is true "
    "(apply_bypass_mode copies the rollout_correction block into actor.policy_loss), and old_log_prob then holds "
    "the rollout log-probs: the IS weights and rejection are computed inside the loss, per micro-batch."
)
BATCH_NORMALIZE_NOTE = (
    "bypass_mode with rollout_is_batch_normalize: verl divides by the weights' mean over the micro-batch (all-reduced "
    "over the ranks' same micro-batch when torch.distributed is initialised), not over the step: bypass_is/"
    "bypass_is_seq with batch_normalize do the same. A step-wide mean has no bypass-mode equivalent in verl."
)
GSPO_NOTE = (
    "gspo: verl clamps the log sequence ratio at 10 from above only; gspo_token clamps it to [-10, 10]: identical "
    "unless a response's mean log-ratio is below -10 (ratio < 4.5e-5)."
)


@dataclass(frozen=True)
class PolicyStages:
    """The gates of a verl loss mode (update gate first), and a reduction when the mode ignores ``loss_agg_mode``
    (None: the caller maps ``loss_agg_mode``)."""

    gates: list[dict[str, Any]]
    reduction: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def _section(source: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = source.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise LossplugError(f"{where}.{key} must be a mapping, got {type(value).__name__}")
    return value


def _value(source: Mapping[str, Any], defaults: Mapping[str, Any], key: str) -> Any:
    value = source.get(key)
    return defaults[key] if value is None else value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossplugError(f"{where} must be a number, got {value!r}")
    return float(value)


def _clip_range(actor: Mapping[str, Any]) -> tuple[float, float]:
    """(eps_low, eps_high): clip_ratio_low/high, each falling back to clip_ratio (verl's rule)."""
    clip = _number(_value(actor, ACTOR_DEFAULTS, "clip_ratio"), "actor.clip_ratio")
    low, high = (
        actor.get("clip_ratio_low", ACTOR_DEFAULTS["clip_ratio_low"]),
        actor.get("clip_ratio_high", ACTOR_DEFAULTS["clip_ratio_high"]),
    )
    return (
        clip if low is None else _number(low, "actor.clip_ratio_low"),
        clip if high is None else _number(high, "actor.clip_ratio_high"),
    )


def _clip_c(actor: Mapping[str, Any]) -> float:
    return _number(_value(actor, ACTOR_DEFAULTS, "clip_ratio_c"), "actor.clip_ratio_c")


def _ppo_clip(actor: Mapping[str, Any]) -> dict[str, Any]:
    """verl's vanilla: clip-higher plus dual-clip, always on (clip_ratio_c must exceed 1, as verl asserts)."""
    low, high = _clip_range(actor)
    clip_c = _clip_c(actor)
    if not clip_c > 1:
        raise LossplugError(f"actor.clip_ratio_c={clip_c}: verl's dual-clip bound must be greater than 1")
    return {"name": "ppo_clip", "eps_low": low, "eps_high": high, "dual_clip_c": clip_c}


# ---------------------------------------------------------------------------------------------------------------------
# bypass_mode


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a number or ``"upper"`` (TIS), or ``"lower_upper"`` (IcePop) → (upper,
    lower)."""
    where = "policy_loss.rollout_correction.rollout_is_threshold"
    lower: float | None = None
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise LossplugError(f"{where} must be a number or a 'lower_upper' string, got {spec!r}")
    try:
        if isinstance(spec, str) and "_" in spec.strip():
            low_text, high_text = spec.strip().split("_", 1)
            lower, upper = float(low_text), float(high_text)
        else:
            upper = float(spec)
    except ValueError:
        raise LossplugError(f"{where}={spec!r} is not a number or a 'lower_upper' pair") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise LossplugError(f"{where}={spec!r}: bounds must be positive with lower <= upper")
    return upper, lower


def parse_rejection_rules(options: Any, thresholds: Any) -> list[dict[str, Any]]:
    """verl's ``rollout_rs`` (comma-chained options) and ``rollout_rs_threshold`` (one spec, or one per option) →
    ``bypass_rs`` rules, with verl's validation (the ``rollout_rs`` gate's parser: one syntax, one set of rules)."""
    where = "policy_loss.rollout_correction.rollout_rs"
    try:
        names = parse_options(options)
    except ValueError as err:
        raise LossplugError(f"{where}={options!r}: {err}") from None
    if thresholds is None:
        raise LossplugError(f"{where}={options!r} needs rollout_rs_threshold (verl requires it)")
    try:
        criteria = parse_thresholds(names, thresholds)
    except ValueError as err:
        raise LossplugError(f"{where}_threshold={thresholds!r}: {err}") from None
    return [
        {"statistic": c.option, "upper": c.upper, **({"lower": c.lower} if c.lower is not None else {})}
        for c in criteria
    ]


def _bypass(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    if policy.get("rollout_correction") is None:
        raise LossplugError(
            "actor.policy_loss.rollout_correction is missing: loss_mode=bypass_mode reads its loss_type and IS / "
            "rejection settings there (verl's apply_bypass_mode copies algorithm.rollout_correction into it)"
        )
    corr = _section(policy, "rollout_correction", "actor.policy_loss")
    loss_type = _value(corr, ROLLOUT_CORRECTION_DEFAULTS, "loss_type")
    if loss_type == "reinforce":
        gates: list[dict[str, Any]] = [{"name": "reinforce"}]
        level = corr.get("rollout_is", ROLLOUT_CORRECTION_DEFAULTS["rollout_is"])
        threshold = corr.get("rollout_is_threshold", ROLLOUT_CORRECTION_DEFAULTS["rollout_is_threshold"])
        if level is not None and threshold is not None:
            if level not in ("token", "sequence"):
                raise LossplugError(
                    f"actor.policy_loss.rollout_correction.rollout_is={level!r}: verl's levels are token, sequence"
                )
            upper, lower = parse_is_threshold(threshold)
            normalize = bool(_value(corr, ROLLOUT_CORRECTION_DEFAULTS, "rollout_is_batch_normalize"))
            gates.append(
                {
                    "name": "bypass_is" if level == "token" else "bypass_is_seq",
                    "cap": upper,
                    "low": lower,
                    "batch_normalize": normalize,
                }
            )
    elif loss_type == "ppo_clip":
        gates = [_ppo_clip(actor)]  # verl computes the IS weights for its metrics only here
    else:
        raise LossplugError(
            f"actor.policy_loss.rollout_correction.loss_type={loss_type!r}: verl's are 'reinforce' and 'ppo_clip'"
        )
    options = corr.get("rollout_rs")
    if options is not None:
        rules = parse_rejection_rules(options, corr.get("rollout_rs_threshold"))
        agg = _value(actor, ACTOR_DEFAULTS, "loss_agg_mode")
        # verl removes rejected tokens from the mask: only seq-mean-token-mean's per-response mean notices
        renormalize = agg == "seq-mean-token-mean" and any(r["statistic"].startswith("token") for r in rules)
        gates.append({"name": "bypass_rs", "rules": rules, "renormalize": renormalize})
    notes = [BYPASS_NOTE]
    if any(g.get("batch_normalize") for g in gates):
        notes.append(BATCH_NORMALIZE_NOTE)
    return PolicyStages(gates, notes=notes)


# ---------------------------------------------------------------------------------------------------------------------
# The modes


def _vanilla(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    return PolicyStages([_ppo_clip(actor)])


def _gspo(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    low, high = _clip_range(actor)
    return PolicyStages([{"name": "gspo_token", "eps_low": low, "eps_high": high}], notes=[GSPO_NOTE])


def _sapo(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    tau_pos = _number(_value(actor, ACTOR_DEFAULTS, "tau_pos"), "actor.tau_pos")
    tau_neg = _number(_value(actor, ACTOR_DEFAULTS, "tau_neg"), "actor.tau_neg")
    return PolicyStages(
        [{"name": "sapo", "tau_pos": tau_pos, "tau_neg": tau_neg}], {"name": "response"}, notes=[SAPO_NOTE]
    )


def _cispo(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    low, high = _clip_range(actor)
    return PolicyStages([{"name": "cispo", "eps_low": low, "eps_high": high}])


def _gpg(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    return PolicyStages([{"name": "reinforce"}])


def _dppo(name: str) -> Callable[[Mapping[str, Any], Mapping[str, Any]], PolicyStages]:
    def build(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
        low, high = _clip_range(actor)
        return PolicyStages([{"name": name, "eps_low": low, "eps_high": high, "ratio_cap": _clip_c(actor)}])

    return build


def _clip_cov(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    low, high = _clip_range(actor)
    ratio = _number(_value(policy, POLICY_LOSS_DEFAULTS, "clip_cov_ratio"), "actor.policy_loss.clip_cov_ratio")
    if not 0 < ratio <= 1:
        raise LossplugError(f"actor.policy_loss.clip_cov_ratio={ratio} must be in (0, 1]")
    gate = {
        "name": "clip_cov",
        "eps_low": low,
        "eps_high": high,
        "ratio": ratio,
        "lb": _number(_value(policy, POLICY_LOSS_DEFAULTS, "clip_cov_lb"), "actor.policy_loss.clip_cov_lb"),
        "ub": _number(_value(policy, POLICY_LOSS_DEFAULTS, "clip_cov_ub"), "actor.policy_loss.clip_cov_ub"),
    }
    return PolicyStages([gate], notes=[COVARIANCE_NOTE.format(mode="clip_cov"), CLIP_COV_RNG_NOTE])


def _kl_cov(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    ratio = _number(_value(policy, POLICY_LOSS_DEFAULTS, "kl_cov_ratio"), "actor.policy_loss.kl_cov_ratio")
    if not 0 < ratio <= 1:
        raise LossplugError(f"actor.policy_loss.kl_cov_ratio={ratio} must be in (0, 1]")
    # verl's function falls back to 1.0 when ppo_kl_coef is None (its config default is 0.1)
    coef = policy.get("ppo_kl_coef", POLICY_LOSS_DEFAULTS["ppo_kl_coef"])
    coef = 1.0 if coef is None else _number(coef, "actor.policy_loss.ppo_kl_coef")
    return PolicyStages(
        [{"name": "kl_cov", "ratio": ratio, "coef": coef}], notes=[COVARIANCE_NOTE.format(mode="kl_cov")]
    )


def _geo_mean(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    low, high = _clip_range(actor)
    return PolicyStages(
        [{"name": "gmpo", "eps_low": low, "eps_high": high}],
        {"name": "response", "population": "micro_batch"},
        notes=[GEO_MEAN_NOTE],
    )


def _dro(actor: Mapping[str, Any], policy: Mapping[str, Any]) -> PolicyStages:
    beta = policy.get("dro_beta")
    if beta is None or isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise LossplugError(
            f"actor.policy_loss.dro_beta={beta!r}: loss_mode=dro needs a positive dro_beta (verl has no default)"
        )
    return PolicyStages([{"name": "dro", "beta": float(beta)}])


MODES: dict[str, Callable[[Mapping[str, Any], Mapping[str, Any]], PolicyStages]] = {
    "vanilla": _vanilla,
    "gspo": _gspo,
    "sapo": _sapo,
    "cispo": _cispo,
    "gpg": _gpg,
    "dppo_tv": _dppo("dppo_tv"),
    "dppo_kl": _dppo("dppo_kl"),
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "geo_mean": _geo_mean,
    "dro": _dro,
    "bypass_mode": _bypass,
}


def policy_gates(actor: Mapping[str, Any]) -> PolicyStages:
    """The gates (and, for the modes that ignore ``loss_agg_mode``, the reduction) reproducing verl's
    ``actor.policy_loss.loss_mode`` with the parameters it reads; a setting without an exact equivalent raises a
    :class:`~lossplug.LossplugError` naming it."""
    if not isinstance(actor, Mapping):
        raise LossplugError(f"actor config must be a mapping (OmegaConf.to_container), got {type(actor).__name__}")
    policy = _section(actor, "policy_loss", "actor")
    mode = _value(policy, POLICY_LOSS_DEFAULTS, "loss_mode")
    if mode == "lossplug":
        raise LossplugError(
            "actor.policy_loss.loss_mode=lossplug already runs a lossplug recipe: use "
            "actor.policy_loss.recipe itself, not a translation"
        )
    build = MODES.get(mode)
    if build is None:
        raise LossplugError(
            f"actor.policy_loss.loss_mode={mode!r} has no lossplug equivalent (verl 0.9.1's modes: {', '.join(MODES)})"
        )
    return build(actor, policy)

"""Validation reads a step's constant tensors once: slices of a checked base skip the pass, and nothing is missed.

The memo (``contracts.memo.CheckedTensors``) remembers whole-tensor outcomes by object. These tests count the value
passes (``torch.aminmax`` calls) and show that every way a remembered tensor can change — a new tensor at the same
address, a stricter rule, and an in-place write through any view that the loss would read (``policy_loss`` checks
again without the memo when its loss is not finite) — is still caught.
"""

import gc

import pytest
import torch

import lossplug
from lossplug import BatchValidationError, PolicyBatch
from lossplug.contracts import memo
from lossplug.contracts.batch import forget_checked

B, T, MICRO = 8, 32, 2


pytestmark = pytest.mark.usefixtures("contract_flag_path")


@pytest.fixture
def passes(monkeypatch):
    """The shapes of the [B, T] value passes since the last reset: ``aminmax`` (log-prob rules) and whole-tensor
    ``sum`` (finiteness of the other fields)."""
    calls = []
    real_aminmax, real_sum = torch.aminmax, torch.Tensor.sum

    def counting_aminmax(x, *a, **kw):
        calls.append(tuple(x.shape))
        return real_aminmax(x, *a, **kw)

    def counting_sum(x, *a, **kw):
        if x.ndim == 2 and not a and not kw:
            calls.append(tuple(x.shape))
        return real_sum(x, *a, **kw)

    monkeypatch.setattr(torch, "aminmax", counting_aminmax)
    monkeypatch.setattr(torch.Tensor, "sum", counting_sum)
    return calls


def step_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=g) * 3
    ref = old - 0.1 * torch.rand(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    return dict(old_logp=old, ref_logp=ref, advantage=adv, action_mask=mask)


def micro_batches(step):
    """TRL's split_tensor_dict / verl's split: views of the step's tensors."""
    for start in range(0, B, MICRO):
        yield {k: v[start : start + MICRO] for k, v in step.items()}


def fresh_logp(mb):
    return (mb["old_logp"] + 0.01).clamp(max=0).detach().clone()


def test_slices_of_a_checked_base_are_not_read_again(passes):
    step = step_batch()
    for _epoch in range(2):
        for mb in micro_batches(step):
            PolicyBatch(logp=fresh_logp(mb), **mb)
    micro = (MICRO, T)
    # the first micro-batch reads each constant base once (3 × [B, T]); after that only each fresh logp is read
    assert passes.count((B, T)) == 3
    assert passes.count(micro) == 2 * (B // MICRO)


@pytest.mark.parametrize("write", ["base", "other_slice", "this_slice"])
def test_an_in_place_write_through_any_view_is_caught(write):
    step = step_batch()
    mbs = list(micro_batches(step))
    PolicyBatch(logp=fresh_logp(mbs[0]), **mbs[0])  # remembers the bases
    target = {"base": step["old_logp"], "other_slice": mbs[0]["old_logp"], "this_slice": mbs[1]["old_logp"]}[write]
    with torch.no_grad():
        if write == "base":
            target[3, 0] = float("nan")  # row 3 is in micro-batch 1
        else:
            target[1 if write == "this_slice" else 0, 0] = float("nan")
    bad = mbs[1] if write != "other_slice" else mbs[0]
    logp = fresh_logp(bad).nan_to_num().requires_grad_(True)
    # the remembered base is trusted by the contract's quick path; the loss it would poison is not
    with pytest.raises(BatchValidationError, match=r"old_logp: must be finite on action positions .*\(row"):
        lossplug.policy_loss(PolicyBatch.unchecked(logp=logp, **bad), "dapo")
    forget_checked()  # outside policy_loss: what a caller that writes in place does
    with pytest.raises(BatchValidationError, match="old_logp: must be finite on action positions"):
        PolicyBatch(logp=logp, **bad)


def test_a_new_tensor_at_a_freed_address_is_checked():
    step = step_batch()
    PolicyBatch(logp=fresh_logp(step), **step)
    entries = len(memo.CHECKED)
    old = step.pop("old_logp")
    del old
    gc.collect()
    assert len(memo.CHECKED) == entries - 1  # the entry died with its tensor
    step["old_logp"] = torch.full((B, T), float("nan"))
    with pytest.raises(BatchValidationError, match="old_logp: must be finite"):
        PolicyBatch(logp=torch.full((B, T), -1.0), **step)


def test_garbage_off_the_actions_leaves_slices_checked_on_their_own(passes):
    step = step_batch()
    step["old_logp"] = step["old_logp"].masked_fill(~step["action_mask"], float("nan"))
    for mb in micro_batches(step):
        PolicyBatch(logp=fresh_logp(mb).nan_to_num(-1.0), **mb)
    # old_logp's base is read once, fails as a whole (NaN padding) and is remembered as such; each slice is then
    # checked on its own (its masked check included), never the base again
    assert passes.count((B, T)) == 3
    # per micro-batch: logp, then old_logp's slice as a whole and on its actions — except the first, where the
    # base's failed whole check stands in for the slice's
    assert passes.count((MICRO, T)) == 2 + (B // MICRO - 1) * 3


def test_a_stricter_rule_is_not_skipped():
    """A tensor remembered as finite (an advantage) is not thereby a valid log-prob."""
    step = step_batch()
    positive = step["advantage"].abs() + 0.5
    PolicyBatch(logp=fresh_logp(step), **{**step, "advantage": positive})
    with pytest.raises(BatchValidationError, match="ref_logp: log-probs must be <= 0"):
        PolicyBatch(logp=fresh_logp(step), **{**step, "ref_logp": positive})


def test_a_base_far_larger_than_the_slice_is_not_read(passes):
    big = -torch.rand(4096, T)
    mask = torch.ones(2, T, dtype=torch.bool)
    PolicyBatch(logp=torch.full((2, T), -1.0), old_logp=big[:2], action_mask=mask)
    assert (4096, T) not in passes


def test_forget_checked_reads_everything_again(passes):
    step = step_batch()
    PolicyBatch(logp=fresh_logp(step), **step)
    PolicyBatch(logp=fresh_logp(step), **step)
    assert passes.count((B, T)) == 3 + 1 + 1  # once each, then the fresh logp only
    forget_checked()
    PolicyBatch(logp=fresh_logp(step), **step)
    assert passes.count((B, T)) == 5 + 4


def test_on_policy_old_logp_sharing_logp_memory_is_read_once(passes):
    step = step_batch()
    logp = fresh_logp(step).requires_grad_()
    PolicyBatch(logp=logp, old_logp=logp.detach(), action_mask=step["action_mask"])
    assert passes.count((B, T)) == 1


@pytest.fixture
def mask_passes(monkeypatch):
    """The shapes of the masks whose rows were read (the ``uint8`` view's per-row max)."""
    calls = []
    real_amax = torch.Tensor.amax

    def counting_amax(x, *a, **kw):
        if x.dtype == torch.uint8:
            calls.append(tuple(x.shape))
        return real_amax(x, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "amax", counting_amax)
    return calls


def test_the_steps_mask_is_read_once(mask_passes, contract_flag_path):
    step = step_batch()
    for mb in micro_batches(step):
        PolicyBatch(logp=fresh_logp(mb), **mb)
    if contract_flag_path == "host":  # (queued flags on an accelerator are not remembered: one read per batch)
        assert mask_passes == [(B, T)]


def test_a_mask_with_an_empty_row_checks_each_micro_batch_on_its_own(mask_passes):
    step = step_batch()
    step["action_mask"][5] = False  # row 5 lies in micro-batch 2
    outcomes = []
    for mb in micro_batches(step):
        try:
            PolicyBatch(logp=fresh_logp(mb), **mb)
            outcomes.append("ok")
        except BatchValidationError as err:
            assert "every response needs at least one action token" in str(err) and "row [1]" in str(err)
            outcomes.append("empty")
    assert outcomes == ["ok", "ok", "empty", "ok"]


def test_a_fresh_logp_is_never_remembered():
    """The forward's logp (it carries gradient) is read every time and leaves no memo entry behind."""
    step = step_batch()
    before = len(memo.CHECKED)
    logp = fresh_logp(step).requires_grad_()
    PolicyBatch(logp=logp, **step)
    assert memo.CHECKED.get(logp) is None
    assert len(memo.CHECKED) <= before + 4  # the constant fields' bases only
    with torch.no_grad():
        logp[0, 0] = float("nan")
    with pytest.raises(BatchValidationError, match="logp: must be finite"):
        PolicyBatch(logp=logp, **step)


def test_per_response_fields_are_read_once_per_step(monkeypatch, contract_flag_path):
    step = step_batch()
    step["advantage"] = torch.randn(B)
    reads = []
    real_sum = torch.Tensor.sum

    def counting_sum(x, *a, **kw):
        if x.ndim == 1 and x.is_floating_point():
            reads.append(tuple(x.shape))
        return real_sum(x, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "sum", counting_sum)
    for mb in micro_batches(step):
        PolicyBatch(logp=fresh_logp(mb), **mb)
    if contract_flag_path == "host":  # (queued flags on an accelerator are not remembered: one read per batch)
        assert reads.count((B,)) == 1 and (MICRO,) not in reads
    with torch.no_grad():
        step["advantage"][7] = float("inf")  # micro-batch 3: written in place after the step's base was checked
    mbs = list(micro_batches(step))
    lossplug.policy_loss(PolicyBatch.unchecked(logp=fresh_logp(mbs[0]), **mbs[0]), "dapo")  # its slice is finite
    with pytest.raises(BatchValidationError, match="advantage: must be finite"):
        lossplug.policy_loss(PolicyBatch.unchecked(logp=fresh_logp(mbs[3]), **mbs[3]), "dapo")

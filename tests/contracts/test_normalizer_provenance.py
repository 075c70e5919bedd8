import pytest
import torch

from lossplug import LogProbSource, LossplugError, Normalizer, Provenance


def test_normalizer_counts_masks_and_groups():
    masks = [torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), torch.tensor([[1, 1]], dtype=torch.bool)]
    norm = Normalizer.for_masks(masks, budget=8, group_ids=[torch.tensor([0, 0]), torch.tensor([1])])
    assert (norm.action_tokens, norm.sequences, norm.groups, norm.budget) == (5, 3, 2, 8)


def test_normalizer_rejects_non_positive_counts():
    with pytest.raises(Exception, match="greater than 0"):
        Normalizer(action_tokens=0, sequences=1)


def test_normalizer_refuses_a_population_smaller_than_the_micro_batch():
    with pytest.raises(LossplugError, match="smaller than this micro-batch alone"):
        Normalizer(action_tokens=3, sequences=2).check_covers(action_tokens=5, sequences=2)


def test_provenance_refuses_mixed_conventions_on_a_ratio():
    vllm = LogProbSource(engine="vllm", temperature=1.0, checkpoint="step-10")
    trainer = LogProbSource(engine="transformers", temperature=0.7, checkpoint="step-10")
    with pytest.raises(
        LossplugError, match="engine ratio compares old and behavior log-probs computed under different"
    ):
        Provenance(behavior=vllm, old=trainer, current=trainer).check()
    ok = Provenance(behavior=vllm, old=vllm, current=vllm, reference=LogProbSource(checkpoint="base")).check()
    assert Provenance.model_validate_json(ok.model_dump_json()) == ok


def test_normalizer_micro_batches_is_optional_validated_and_passed_through():
    assert Normalizer(action_tokens=3, sequences=2).micro_batches is None
    assert Normalizer(action_tokens=3, sequences=2, micro_batches=4.0).micro_batches == 4
    for bad, message in ((0, "greater than 0"), (2.5, "whole number"), (True, "whole number")):
        with pytest.raises(LossplugError, match=rf"Normalizer.micro_batches: must be .*{message}"):
            Normalizer(action_tokens=3, sequences=2, micro_batches=bad)
    masks = [torch.ones(2, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool)]
    assert Normalizer.for_masks(masks).micro_batches is None  # not counted: the masks may be the step in one tensor
    norm = Normalizer.for_masks(masks, micro_batches=2)
    assert norm.micro_batches == 2
    assert Normalizer.model_validate_json(norm.model_dump_json()) == norm


def test_micro_batch_regularizer_weighs_one_over_the_step_micro_batches():
    """A ``population: micro_batch`` regularizer: with ``micro_batches`` each micro-batch's own mean weighs 1 / their
    number, also when a micro-batch lost rows (the trainer's mean of per-micro-batch means); without it, rows /
    sequences."""
    import lossplug

    recipe = {
        "gates": ["ppo_clip"],
        "reduction": "token",
        "regularizers": [{"name": "entropy", "coef": 1.0, "reduction": "token", "population": "micro_batch"}],
    }
    gen = torch.Generator().manual_seed(0)

    def part(rows):
        logp = -torch.rand(rows, 4, generator=gen, dtype=torch.float64)
        entropy = torch.rand(rows, 4, generator=gen, dtype=torch.float64)
        mask = torch.ones(rows, 4, dtype=torch.bool)
        return lossplug.PolicyBatch(
            logp=logp,
            old_logp=logp,
            action_mask=mask,
            advantage=torch.zeros(rows, dtype=torch.float64),
            entropy=entropy,
        )

    parts = [part(3), part(1)]  # the second micro-batch lost two rows (no action token): TRL still weighs it 1/2
    expected = -sum(p.entropy.mean() for p in parts) / 2
    exact = Normalizer(action_tokens=16, sequences=6, micro_batches=2)
    total = sum(lossplug.policy_loss(p, recipe, exact, metrics="off").loss for p in parts)
    torch.testing.assert_close(total, expected, rtol=1e-15, atol=0)
    rows = Normalizer(action_tokens=16, sequences=6)  # rows / sequences: 3/6 and 1/6
    total = sum(lossplug.policy_loss(p, recipe, rows, metrics="off").loss for p in parts)
    torch.testing.assert_close(total, -(parts[0].entropy.mean() * 3 + parts[1].entropy.mean()) / 6, rtol=1e-15, atol=0)


def test_normalizer_all_reduce_sums_micro_batches(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        local = Normalizer(action_tokens=5, sequences=3, groups=2, budget=8, micro_batches=2)
        assert Normalizer.all_reduce(local) == local
        plain = Normalizer(action_tokens=5, sequences=3)
        assert Normalizer.all_reduce(plain).micro_batches is None
    finally:
        dist.destroy_process_group()

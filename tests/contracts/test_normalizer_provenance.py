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

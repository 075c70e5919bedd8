import torch

from lossplug.ops import Groups, masked_quantiles


def test_group_statistics_work_from_scattered_unequal_ids_and_any_dtype():
    groups = Groups.from_ids(torch.tensor([3, 1, 3, 1, 7]))
    assert groups.counts.tolist() == [2, 2, 1]
    assert groups.amax(torch.tensor([1, 2, 5, 0, 4])).tolist() == [2, 5, 4]  # integer rewards: no inf fill
    assert groups.amin(torch.tensor([1.0, 2.0, 5.0, 0.0, 4.0])).tolist() == [0.0, 1.0, 4.0]
    assert groups.constant(torch.tensor([1, 1, 1, 0, 4])).tolist() == [False, True, True]
    x = torch.tensor([1.0, 2.0, 5.0, 0.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(groups.mean(x), torch.tensor([1.0, 3.0, 4.0], dtype=torch.float64))
    torch.testing.assert_close(groups.std(x, unbiased=False), torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64))


def test_masked_quantiles_ignore_masked_values():
    x = torch.tensor([[1.0, float("nan"), 3.0], [100.0, 2.0, -float("inf")]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    assert masked_quantiles(x, mask, (0.0, 0.5, 1.0)).tolist() == [1.0, 2.0, 3.0]

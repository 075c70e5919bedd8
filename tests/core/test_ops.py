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


def test_count_true_counts_like_count_nonzero():
    from lossplug.ops import count_true

    g = torch.Generator().manual_seed(0)
    mask = torch.rand(64, 300, generator=g) > 0.3
    for dim in (None, -1, 0):
        ours = count_true(mask, dim)
        theirs = torch.count_nonzero(mask) if dim is None else torch.count_nonzero(mask, dim)
        assert ours.dtype == theirs.dtype == torch.int64 and torch.equal(ours, theirs)
    floats = torch.tensor([0.0, -0.0, 2.0, float("nan")])
    assert torch.equal(count_true(floats), torch.count_nonzero(floats))  # not bool: count_nonzero itself


def test_zero_off_fresh_equals_zero_off_in_value_and_gradient():
    from lossplug.ops import action_bits, zero_off, zero_off_fresh

    g = torch.Generator().manual_seed(1)
    mask = torch.rand(32, 1024, generator=g) > 0.25  # past the bitwise path's threshold
    old = torch.where(mask, -torch.rand(32, 1024, generator=g), float("nan"))
    base = torch.where(mask, old + 0.1, float("inf"))
    bits = action_bits(mask, torch.float32)
    grads, values = [], []
    for zero in (zero_off, zero_off_fresh):
        logp = base.clone().requires_grad_(True)
        out = zero(logp - old, mask, bits)  # a fresh temporary: zero_off_fresh writes into it
        (out.exp() * 3).sum().backward()
        values.append(out.detach())
        grads.append(logp.grad)
    assert torch.equal(values[0], values[1]) and torch.equal(grads[0], grads[1])
    assert values[1][~mask].eq(0).all() and grads[1][~mask].eq(0).all()
    leaf = base.clone().requires_grad_(True)  # a leaf is never written in place
    assert torch.equal(zero_off_fresh(leaf, mask, bits), zero_off(leaf, mask, bits)) and leaf.isinf().any()
    plain = torch.where(mask, base, float("nan"))
    assert torch.equal(zero_off_fresh(plain.clone(), mask), zero_off(plain, mask))  # no gradient: in place


def test_count_moved_counts_what_the_clamp_moved_like_the_comparisons():
    from lossplug.ops import clamp_moved_fast, count_moved

    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0, 0.0, 5.0, 0.8, 7.0, 0.1])
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.float64):
        x = torch.cat([special, torch.rand(4000, generator=g) * 3]).to(dtype).reshape(-1, 1)
        for low, high in ((None, 5.0), (0.8, 5.0), (0.8, None)):
            clamped = x.clamp(min=low, max=high)
            assert clamp_moved_fast(x, clamped)
            expected = torch.zeros_like(x, dtype=torch.bool)
            if high is not None:
                expected |= x > high
            if low is not None:
                expected |= x < low
            ours = count_moved(x, clamped)
            assert ours.dtype == torch.int64 and ours == torch.count_nonzero(expected)

"""Numerical precision of the vectorised GAE against the sequential references.

Tolerances (what these tests assert, and what the docstring of ``lossplug.plugins.advantages.gae`` documents):

* float64: ``|A − A_ref| ≤ 1e-10 · |A_ref| + 1e-10 · max|A_ref|`` element-wise (measured: ≲ 5e-14 relative);
* float32: ``|A − A_ref| ≤ 1e-4 · M_t``, with ``A_ref`` the float64 recursion on the same (float32-rounded) inputs
  and ``M_t = Σ_k (γλ)^k |δ_{t+k}|`` the magnitude of the terms summed into ``A_t`` (measured: ≤ 3e-5 at 1M
  transitions with γλ = 0.9999, ≤ 3e-7 for γλ ≤ 0.999; the float32 sequential loop has errors of the same order).

Long fragments (8k tokens and more) are where a naive scan that divides by a cumulative product of the coefficients
loses everything: ``0.95^8192`` underflows. The blocked scan only multiplies coefficients together and adds terms.
"""

import pytest
import torch

import lossplug
from lossplug.plugins.advantages.gae import packed_gae, reverse_linear_scan
from lossplug.testing.reference import sequential_packed_gae

F64, F32 = torch.float64, torch.float32
RTOL64 = 1e-10
RTOL32 = 1e-4


def loop(delta, coef):
    """``a_t = delta_t + coef_t · a_{t+1}``, sequentially in float64 (Python floats)."""
    d, c = delta.double().tolist(), coef.double().tolist()
    out, carry = [0.0] * len(d), 0.0
    for t in range(len(d) - 1, -1, -1):
        carry = d[t] + c[t] * carry
        out[t] = carry
    return torch.tensor(out, dtype=F64)


def assert_close64(ours, ref):
    assert ours.dtype == F64
    torch.testing.assert_close(ours, ref, rtol=RTOL64, atol=RTOL64 * float(ref.abs().max()))


def assert_close32(ours, ref, magnitude):
    assert ours.dtype == F32
    err = (ours.double() - ref).abs()
    worst = float((err / magnitude.clamp(min=1e-30)).max())
    assert worst <= RTOL32, f"float32 error {worst:.3g} × magnitude exceeds the documented {RTOL32}"


def fragments(n, mean_len, gen, dtype=F64):
    """Packed transitions of mixed-length fragments with terminals (NaN next_value) and time-limit truncations."""
    boundary = torch.rand(n, generator=gen) < 1 / mean_len
    boundary[-1] = True
    terminated = boundary & (torch.rand(n, generator=gen) < 0.5)
    return dict(
        reward=torch.randn(n, generator=gen, dtype=dtype),
        value=torch.randn(n, generator=gen, dtype=dtype),
        next_value=torch.randn(n, generator=gen, dtype=dtype).masked_fill(terminated, float("nan")),
        terminated=terminated,
        boundary=boundary,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The scan kernel


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 127, 4095, 4096, 4097, 64**3 + 1])
def test_scan_matches_the_loop_around_block_sizes(n):
    gen = torch.Generator().manual_seed(n)
    d = torch.randn(n, generator=gen, dtype=F64)
    c = torch.rand(n, generator=gen, dtype=F64) * (torch.rand(n, generator=gen) > 0.02)
    d0, c0 = d.clone(), c.clone()
    out = reverse_linear_scan(d, c)
    assert out.shape == (n,)
    if n:
        assert_close64(out, loop(d, c))
    assert torch.equal(d, d0) and torch.equal(c, c0)  # inputs are never written


@pytest.mark.parametrize("coef", [1.0, 0.99, 0.95])
def test_scan_on_a_long_fragment_float64(coef):
    gen = torch.Generator().manual_seed(1)
    n = 1 << 14
    d = torch.randn(n, generator=gen, dtype=F64) + 0.5
    c = torch.full((n,), coef, dtype=F64)
    assert_close64(reverse_linear_scan(d, c), loop(d, c))


@pytest.mark.parametrize("coef,n", [(1.0, 8192), (0.95, 8192), (0.999, 8192), (0.9999, 8192), (0.9999, 1 << 17)])
def test_scan_float32_tolerance(coef, n):
    gen = torch.Generator().manual_seed(2)
    d = torch.randn(n, generator=gen, dtype=F32) + 1.0
    c = torch.full((n,), coef, dtype=F32)
    assert_close32(reverse_linear_scan(d, c), loop(d, c), loop(d.abs(), c))


def test_long_fragment_where_a_cumprod_divide_scan_breaks():
    n = 8192
    gen = torch.Generator().manual_seed(3)
    d = torch.randn(n, generator=gen, dtype=F32)
    c = torch.full((n,), 0.95, dtype=F32)

    # the naive closed form A_t = (Σ_{u≥t} P_u δ_u) / P_t with P_t = Π_{u<t} c_u: P underflows to 0 long before 8k
    p = torch.cat((torch.ones(1), torch.cumprod(c, 0)[:-1]))
    naive = torch.flip(torch.cumsum(torch.flip(p * d, (0,)), 0), (0,)) / p
    assert not torch.isfinite(naive).all()  # the failure mode this test guards against

    ours = reverse_linear_scan(d, c)
    assert torch.isfinite(ours).all()
    assert_close32(ours, loop(d, c), loop(d.abs(), c))
    assert_close64(reverse_linear_scan(d.double(), c.double()), loop(d, c))


def test_huge_values_do_not_overflow_float32():
    # terms near float32's range: only sums of (bounded) terms are formed, no intermediate blows up
    n = 8192
    d = torch.full((n,), 1e30, dtype=F32)
    c = torch.full((n,), 0.5, dtype=F32)
    out = reverse_linear_scan(d, c)
    assert torch.isfinite(out).all()
    assert_close32(out, loop(d, c), loop(d.abs(), c))


# ---------------------------------------------------------------------------------------------------------------------
# Packed GAE against the sequential loop


def test_packed_gae_matches_the_sequential_loop_float64_long_mixed_fragments():
    gen = torch.Generator().manual_seed(4)
    kw = fragments(20_000, 2_000, gen)  # fragments of ~2k transitions, the longest several thousand
    kw["boundary"][:8192] = False  # and one fragment of at least 8k transitions
    kw["terminated"][:8192] = False
    kw["next_value"][:8192] = torch.randn(8192, generator=gen, dtype=F64)
    assert_close64(packed_gae(**kw, gamma=0.999, lam=0.97), sequential_packed_gae(**kw, gamma=0.999, lam=0.97))


def test_packed_gae_float32_tolerance():
    gen = torch.Generator().manual_seed(5)
    kw = fragments(30_000, 3_000, gen, dtype=F32)
    gamma, lam = 1.0, 0.999
    ours = packed_gae(**kw, gamma=gamma, lam=lam)
    bootstrap = torch.where(kw["terminated"], 0, kw["next_value"]).double()
    delta = kw["reward"].double() + gamma * bootstrap - kw["value"].double()
    coef = torch.where(kw["boundary"], 0.0, torch.tensor(gamma * lam, dtype=F32).double())
    assert_close32(ours, loop(delta, coef), loop(delta.abs(), coef))


def test_packed_gae_honours_terminated_boundary_and_truncation_at_length():
    # three long fragments: terminated (NaN next_value, no bootstrap), truncated (bootstraps from the real final
    # observation, does not chain into the next one), terminated again
    n1, n2, n3 = 5000, 8192, 3000
    n = n1 + n2 + n3
    gen = torch.Generator().manual_seed(6)
    reward, value = torch.randn(n, generator=gen, dtype=F64), torch.randn(n, generator=gen, dtype=F64)
    next_value = torch.cat((value[1:], torch.zeros(1, dtype=F64)))
    boundary = torch.zeros(n, dtype=torch.bool)
    terminated = torch.zeros(n, dtype=torch.bool)
    for end, term in ((n1 - 1, True), (n1 + n2 - 1, False), (n - 1, True)):
        boundary[end], terminated[end] = True, term
        next_value[end] = float("nan") if term else 7.0
    kw = dict(reward=reward, value=value, next_value=next_value, terminated=terminated, boundary=boundary)
    ours = packed_gae(**kw, gamma=1.0, lam=0.98)
    assert_close64(ours, sequential_packed_gae(**kw, gamma=1.0, lam=0.98))
    # the truncated fragment ends with δ = r + V_final − V, and nothing of the third fragment reaches it
    torch.testing.assert_close(ours[n1 + n2 - 1], reward[n1 + n2 - 1] + 7.0 - value[n1 + n2 - 1])
    changed = packed_gae(**{**kw, "reward": reward + (torch.arange(n) >= n1 + n2) * 1e6}, gamma=1.0, lam=0.98)
    assert torch.equal(changed[: n1 + n2], ours[: n1 + n2])


# ---------------------------------------------------------------------------------------------------------------------
# Padded GAE against a sequential loop over each row's action tokens


def padded_reference(reward_tok, value, mask, gamma, lam, end_value):
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=F64)
    mag = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        idx = mask[b].nonzero().squeeze(-1)
        v = value[b, idx].double()
        nxt = torch.cat((v[1:], torch.tensor([float(end_value[b])], dtype=F64)))
        delta = reward_tok[b, idx].double() + gamma * nxt - v
        coef = torch.full_like(delta, float(torch.tensor(gamma * lam, dtype=value.dtype)))
        adv[b, idx] = loop(delta, coef)
        mag[b, idx] = loop(delta.abs(), coef)
    return adv, mag


@pytest.mark.parametrize("dtype", [F64, F32])
def test_padded_gae_long_rows_with_gaps_and_truncation(dtype):
    gen = torch.Generator().manual_seed(7)
    B, T = 4, 10_000
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (start, end) in enumerate([(0, T), (100, 9000), (3000, 3001), (0, 8500)]):
        mask[b, start:end] = True
    mask[1, 200:260] = False  # an observation span inside a multi-turn response
    mask[3] &= torch.rand(T, generator=gen) > 0.05  # scattered tool tokens
    mask[3, 0] = True
    value = torch.randn(B, T, generator=gen, dtype=dtype)
    reward = torch.randn(B, T, generator=gen, dtype=dtype)
    terminated = torch.tensor([True, False, True, False])
    final_value = torch.tensor([float("nan"), 2.0, float("nan"), -3.0], dtype=dtype)
    # non-action positions hold garbage that must never be read (a token reward 0 there: the contract's rule)
    batch = lossplug.PolicyBatch(
        logp=torch.full((B, T), -1.0, dtype=dtype),
        action_mask=mask,
        value=value.masked_fill(~mask, float("nan")),
        reward=reward.masked_fill(~mask, 0),
        terminated=terminated,
        final_value=final_value,
    )
    recipe = lossplug.Recipe.model_validate(
        {
            "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.999, "whiten": False},
            "gates": ["ppo_clip"],
            "reduction": "token",
        }
    )
    res = lossplug.estimate_advantages(batch, recipe)
    ref, mag = padded_reference(reward, value, mask, 1.0, 0.999, torch.where(terminated, 0, final_value.double()))
    assert (res.advantage[~mask] == 0).all()
    if dtype == F64:
        assert_close64(res.advantage, ref)
        assert_close64(res.returns, torch.where(mask, ref + value, 0))
    else:
        assert_close32(res.advantage, ref, torch.where(mask, mag, 1.0))


def test_padded_gae_with_empty_rows_when_validation_is_off():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]], dtype=torch.bool)
    value = torch.tensor([[1.0, 2.0, 9.0], [9.0, 9.0, 9.0], [9.0, 3.0, 4.0]], dtype=F64)
    batch = lossplug.PolicyBatch.unchecked(
        logp=torch.zeros(3, 3, dtype=F64),
        action_mask=mask,
        value=value,
        reward=torch.tensor([1.0, 5.0, 2.0], dtype=F64),
    )
    recipe = lossplug.Recipe.model_validate(
        {
            "advantage": {"name": "gae", "gamma": 1.0, "lam": 1.0, "whiten": False},
            "gates": ["ppo_clip"],
            "reduction": "token",
        }
    )
    adv = lossplug.compute_advantages(batch, recipe, validate="off")
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, -1.0, -2.0]], dtype=F64))

"""The sampling race in one pass per row (kernels/csrc/cpu_paged.cpp, ``race_rows``): each row's
token is ``argmax_i w_i / E_i`` with ``E_i = -ln u_i`` and ``u_i`` from SplitMix64 keyed by the
row's key, ``w_i = exp((x_i - max x) / T)`` from logits or ``w_i = x_i`` from weights. Checked
against that formula in float64 (so the noise is the documented stream), as a distribution,
for tokens of weight 0 (never drawn), temperature 0 (the argmax), and a row's draw depending
on its key and its own values alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_paged

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="no C++ extension here")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _uniform(key: int, n: int) -> np.ndarray:
    """u_0 .. u_{n-1} of ``key`` as the kernel documents them, in float64."""
    with np.errstate(over="ignore"):
        z = np.uint64(key) + np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    r = (z >> np.uint64(41)).astype(np.float64)
    return (2 * r + 1) / 2.0**24


def _reference(w: np.ndarray, key: int) -> tuple[int, float]:
    """The race's winner for weights ``w`` (float64) and the ratio of its score to the
    runner-up's (how far from a tie)."""
    s = w / -np.log(_uniform(key, len(w)))
    order = np.argsort(-s, kind="stable")
    return int(order[0]), float(s[order[0]] / max(s[order[1]], 1e-300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["logits", "weights"])
def test_draws_are_the_documented_race(dtype, mode):
    g = torch.Generator().manual_seed(11)
    n, v = 48, 1007  # a vocabulary that is not a multiple of 16: the masked tail too
    x = torch.randn(n, v, generator=g) * 3
    if mode == "weights":
        x = torch.softmax(x, dim=-1)
        x[:, ::7] = 0.0  # weight 0: never drawn
    x = x.to(dtype)
    temps = torch.rand(n, generator=g) * 1.5 + 0.3
    keys = torch.randint(0, 1 << 62, (n,), generator=g)
    got = cpu_paged.race_rows(x, temps if mode == "logits" else None, keys)
    compared = 0
    for r in range(n):
        xs = x[r].double().numpy()
        w = np.exp((xs - xs.max()) / float(temps[r])) if mode == "logits" else xs
        want, margin = _reference(w, int(keys[r]))
        if margin < 1 + 1e-4:  # fp32 arithmetic may order a near-tie either way
            continue
        compared += 1
        assert int(got[r]) == want, (r, int(got[r]), want)
    assert compared >= n - 3


def test_the_draws_follow_the_weights_and_the_temperature():
    n = 40_000
    weights = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    keys = torch.arange(n) * 7919 + 5
    for x, temps, want in (
        (weights.expand(n, 6).contiguous(), None, weights),
        (weights.log().expand(n, 6).contiguous(), torch.ones(n), weights),
        # temperature 0.5 squares the weights (renormalised)
        (weights.log().expand(n, 6).contiguous(), torch.full((n,), 0.5), weights**2 / 0.3),
    ):
        counts = torch.bincount(cpu_paged.race_rows(x, temps, keys), minlength=6).double() / n
        assert counts[1] == 0 and counts[5] == 0
        # each share's standard error is <= 0.0025; 0.012 is ~5 of them
        assert torch.allclose(counts, want.double(), atol=0.012), counts


def test_a_banned_token_is_never_drawn_however_hot():
    n, v = 2_000, 300
    x = torch.zeros(n, v)
    x[:, 1::2] = float("-inf")
    ids = cpu_paged.race_rows(x, torch.full((n,), 100.0), torch.arange(n))
    assert (ids % 2 == 0).all()
    assert len(ids.unique()) > 140  # and the others all come up (uniform over 150)
    lone = torch.full((3, v), float("-inf"))
    lone[:, 257] = -5.0  # one finite logit in the masked tail's neighbourhood
    assert cpu_paged.race_rows(lone, torch.ones(3), torch.arange(3)).tolist() == [257] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_zero_is_the_argmax(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32000, generator=g).to(dtype)
    x[2, 100] = x[2, 31000] = 50.0  # a tie: the first index, as torch.argmax
    temps = torch.tensor([0.0, 1.0] * 4 + [0.0])  # even rows greedy
    got = cpu_paged.race_rows(x, temps, torch.arange(9))
    assert got[::2].tolist() == cpu_paged.argmax_rows(x)[::2].tolist()
    assert int(got[2]) == 100


def test_a_rows_draw_depends_on_its_key_and_values_alone():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 4099, generator=g).bfloat16()
    temps = torch.rand(37, generator=g) + 0.5
    keys = torch.randint(0, 1 << 62, (37,), generator=g)
    whole = cpu_paged.race_rows(x, temps, keys)
    for r in (0, 17, 36):
        alone = cpu_paged.race_rows(x[r : r + 1], temps[r : r + 1], keys[r : r + 1])
        assert int(alone[0]) == int(whole[r])
    # another key draws otherwise (40 rows of 4,099 tokens: some differ)
    other = cpu_paged.race_rows(x, temps, keys + 1)
    assert not torch.equal(other, whole)


def _kept_reference(x: torch.Tensor, temp: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """The tokens the sampler's torch path keeps (``Sampler._probs``), in float64: vLLM V1's
    order, min-p, then top-k, then top-p of the mass they left."""
    lg = x.double() / temp
    if min_p > 0:
        pr = torch.softmax(lg, dim=-1)
        lg = lg.masked_fill(pr < min_p * pr.max(), float("-inf"))
    if k > 0:
        kth = lg.sort(descending=True).values[k - 1]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    pr = torch.softmax(lg, dim=-1)
    if p < 1:
        sp, si = pr.sort(descending=True)
        sp = sp.masked_fill(sp.cumsum(-1) - sp > p, 0.0)
        pr = torch.zeros_like(pr).scatter(0, si, sp)
    return pr > 0


@pytest.mark.parametrize(
    "k,p,min_p",
    [
        (50, 1.0, 0.0),
        (1, 1.0, 0.0),
        (0, 0.9, 0.0),
        (0, 0.3, 0.0),
        (0, 1.0, 0.05),
        (50, 0.5, 0.0),
        (20, 0.9, 0.1),
        (900, 0.99, 0.0),
        # min-p before top-p: top-p measures the mass min-p left (it measured the whole row's)
        (0, 0.5, 0.3),
        (0, 0.8, 0.1),
        (30, 0.7, 0.05),
    ],
)
def test_cut_rows_keeps_what_the_sort_kept(k, p, min_p):
    """Top-k, top-p and min-p by bisection keep the same tokens as the sort they replace
    (distinct float32 logits: no ties), and the weights are exp((x - max) / T) on them."""
    g = torch.Generator().manual_seed(k + int(p * 100) + int(min_p * 1000))
    n, v = 12, 1003
    x = torch.randn(n, v, generator=g) * 2
    x[:, 5] = float("-inf")
    temps = torch.rand(n, generator=g) + 0.5
    w = cpu_paged.cut_rows(
        x, temps, torch.full((n,), k), torch.full((n,), p), torch.full((n,), min_p)
    )
    for r in range(n):
        kept = _kept_reference(x[r], float(temps[r]), k, p, min_p)
        assert torch.equal(w[r] > 0, kept), r
        full = torch.exp((x[r] - x[r].max()) / temps[r])
        assert torch.allclose(w[r][kept], full[kept], rtol=1e-5)
        assert w[r, 5] == 0


def test_cut_rows_ties_temperature_zero_and_bf16():
    v = 300
    x = torch.arange(v, dtype=torch.float32) / 100
    x[[10, 20, 30]] = 10.0  # three tokens tie for the largest: top-k 2 keeps all three
    w = cpu_paged.cut_rows(
        x.expand(2, v).contiguous(),
        torch.tensor([1.0, 0.0]),  # row 1: temperature 0, the argmax alone (first index)
        torch.tensor([2, 2]),
        torch.ones(2),
        torch.zeros(2),
    )
    assert (w[0] > 0).nonzero().flatten().tolist() == [10, 20, 30]
    assert (w[1] > 0).nonzero().flatten().tolist() == [10] and w[1, 10] == 1
    xb = (torch.randn(4, 4099, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    args = (torch.ones(4), torch.full((4,), 40), torch.full((4,), 0.8), torch.full((4,), 0.02))
    assert torch.equal(cpu_paged.cut_rows(xb, *args), cpu_paged.cut_rows(xb.float(), *args))

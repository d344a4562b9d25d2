"""The sampling noise on CPU, on both of its paths: the backend's one-pass race
(``kernels.cpu_paged.race_rows``, the noise made in the kernel from a key per row), and without
it -log U from numpy's vectorised uniform draw (torch's CPU ``exponential_`` drew one element at
a time, 35 ms for 64 rows of a 32,000-token vocabulary). Each must still be a draw from each
row's distribution, never pick a token of weight 0, and be reproducible from the engine's seed;
a seeded row's draw depends on its seed, position and logits alone, whichever path the batch
takes."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_paged
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SampleSpec

pytestmark = pytest.mark.unit


@pytest.fixture(params=["kernel", "torch"])
def make(request):
    """``make(vocab, seed)``: a CPU sampler with the backend's race and cut kernels, or
    without them."""
    if request.param == "kernel" and not cpu_paged.available():
        pytest.skip("no C++ extension here")
    kernel = request.param == "kernel"
    return lambda vocab, seed: Sampler(
        vocab,
        torch.device("cpu"),
        seed=seed,
        argmax_rows=cpu_paged.argmax_rows,
        race_rows=cpu_paged.race_rows if kernel else None,
        cut_rows=cpu_paged.cut_rows if kernel else None,
    )


def _rows(n: int) -> list[SampleSpec]:
    params = SamplingParams(temperature=1.0)
    return [SampleSpec(f"r{i}", params, 0, ()) for i in range(n)]


def test_unseeded_draws_follow_the_weights_and_skip_zero_weight_tokens(make):
    s = make(6, 1234)
    weights = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    n = 40_000
    ids = s._race(weights.expand(n, 6).contiguous(), _rows(n))
    counts = torch.bincount(ids, minlength=6).double() / n
    assert counts[1] == 0 and counts[5] == 0
    # 40,000 draws: each share's standard error is <= 0.0025; 0.012 is ~5 of them
    assert torch.allclose(counts, weights.double(), atol=0.012), counts


def test_unseeded_draws_are_reproducible_from_the_engine_seed_and_mix_with_seeded_rows(make):
    w = torch.softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    rows = _rows(5)
    rows[2] = SampleSpec("seeded", SamplingParams(temperature=1.0, seed=7), 0, ())
    a = make(50, 99)._race(w, rows)
    b = make(50, 99)._race(w, rows)
    assert torch.equal(a, b)
    # the seeded row's draw depends only on (seed, position), not on its neighbours
    alone = make(50, 5)._race(w[2:3], rows[2:3])
    assert int(alone[0]) == int(a[2])


def test_draws_from_logits_follow_the_softmax_and_top_k(make):
    """From logits (temperature, top-k, softmax, then the race): the draws follow
    softmax(l / T), never take a -inf logit, and never a token outside the row's top-k."""
    s = make(6, 4321)
    weights = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    n = 40_000
    logits = weights.log().expand(n, 6).contiguous()  # log 0 = -inf
    ids = s._sample(logits.clone(), _rows(n))
    counts = torch.bincount(ids, minlength=6).double() / n
    assert counts[1] == 0 and counts[5] == 0
    assert torch.allclose(counts, weights.double(), atol=0.012), counts
    # temperature 0.5 squares the weights (renormalised); top-k 2 keeps tokens 3 and 4 only
    hot = [SampleSpec(f"h{i}", SamplingParams(temperature=0.5, top_k=2), 0, ()) for i in range(n)]
    ids = s._sample(logits.clone(), hot)
    counts = torch.bincount(ids, minlength=6).double() / n
    want = torch.tensor([0, 0, 0, 0.09, 0.16, 0]).double() / 0.25
    assert torch.allclose(counts, want, atol=0.012), counts


def test_a_seeded_row_draws_the_same_beside_a_top_p_row(make):
    """A seeded row's draw does not change with its neighbours, one with top-p included."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 500, generator=g)
    nucleus = SampleSpec("p", SamplingParams(temperature=1.0, top_p=0.5), 0, ())
    for pos in range(20):
        seeded = SampleSpec("s", SamplingParams(temperature=0.8, seed=11), pos, ())
        alone = make(500, 1)._sample(logits[:1].clone(), [seeded])
        mixed = make(500, 2)._sample(logits.clone(), [seeded, nucleus])
        assert int(alone[0]) == int(mixed[0])


def test_a_batch_of_greedy_and_sampled_rows_in_one_pass(make):
    """A batch with temperature alone (the race on the logits as they are, bf16 included):
    greedy rows take the argmax, a seeded row draws as it does alone and as it does in a batch
    that takes the fp32 path (a neighbour asking for logprobs), and the draws follow softmax(l/T)."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 700, generator=g).bfloat16()
    greedy = SampleSpec("g", SamplingParams(temperature=0.0), 0, ())
    plain = SampleSpec("u", SamplingParams(temperature=1.0), 0, ())
    lp = SampleSpec("l", SamplingParams(temperature=1.0, logprobs=2), 0, ())
    for pos in range(10):
        seeded = SampleSpec("s", SamplingParams(temperature=0.7, seed=3), pos, ())
        batch = make(700, 1)(logits, [greedy, seeded, plain])
        assert batch[0].token_id == int(logits[0].float().argmax())
        alone = make(700, 2)(logits[1:2], [seeded])
        fp32 = make(700, 3)(logits[1:3], [seeded, lp])
        assert batch[1].token_id == alone[0].token_id == fp32[0].token_id
    n = 20_000
    w = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    rows = [SampleSpec(f"r{i}", SamplingParams(temperature=1.0), 0, ()) for i in range(n)]
    out = make(5, 9)(w.log().expand(n, 5).contiguous().bfloat16(), rows)
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=5).double() / n
    assert counts[4] == 0
    assert torch.allclose(counts, w.double(), atol=0.017), counts


def test_top_p_and_min_p_draws_follow_the_cut_distribution(make):
    """Top-p keeps the smallest set of the largest weights whose mass reaches p, min-p the
    tokens of at least min_p times the largest; the draws follow the kept weights
    renormalised, in a batch that also has greedy and plain rows (bf16 logits)."""
    n = 30_000
    w = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    logits = w.log().expand(n + 2, 5).contiguous().bfloat16()
    nucleus = [
        SampleSpec(f"p{i}", SamplingParams(temperature=1.0, top_p=0.8), 0, ()) for i in range(n)
    ]
    rows = [SampleSpec("g", SamplingParams(temperature=0.0), 0, ()), *nucleus]
    rows.append(SampleSpec("u", SamplingParams(temperature=1.0), 0, ()))
    out = make(5, 6)(logits, rows)
    assert out[0].token_id == 1
    ids = torch.tensor([t.token_id for t in out[1:-1]])
    counts = torch.bincount(ids, minlength=5).double() / n
    kept = logits[0].float().exp()  # the bf16 weights: 0.4, 0.25, 0.2 reach 0.8
    kept[[0, 4]] = 0
    assert counts[0] == 0 and counts[4] == 0
    assert torch.allclose(counts, (kept / kept.sum()).double(), atol=0.015), counts
    floor = [
        SampleSpec(f"m{i}", SamplingParams(temperature=1.0, min_p=0.3), 0, ()) for i in range(n)
    ]
    ids = torch.tensor([t.token_id for t in make(5, 7)(logits[:n], floor)])
    counts = torch.bincount(ids, minlength=5).double() / n
    kept = logits[0].float().exp()  # at least 0.3 x 0.4: 0.4, 0.25, 0.2
    kept[[0, 4]] = 0
    assert counts[0] == 0 and counts[4] == 0
    assert torch.allclose(counts, (kept / kept.sum()).double(), atol=0.015), counts


def test_min_p_comes_before_top_p_as_in_vllm(make):
    """vLLM V1 applies min-p (after temperature) before top-k / top-p, and top-p measures the
    mass min-p left: [0.40, 0.35, 0.25] with min_p 0.7 keeps [0.40, 0.35], renormalised
    [0.53, 0.47], of which top_p 0.5 keeps token 0 alone. (Top-p first kept tokens 0 and 1,
    then min-p both: token 1 was drawn about half the time.) Both paths, every draw."""
    n = 2_000
    logits = torch.tensor([0.40, 0.35, 0.25, 0.0, 0.0]).log().expand(n, 5).contiguous()
    for top_k in (0, 2, 3):
        params = SamplingParams(temperature=1.0, top_p=0.5, min_p=0.7, top_k=top_k)
        s = make(5, 11)
        probs = s.processed_probs(logits[:1], [SampleSpec("q", params, 0, ())])
        assert (probs[0] > 0).nonzero().flatten().tolist() == [0], top_k
        rows = [SampleSpec(f"r{i}", params, 0, ()) for i in range(n)]
        ids = [t.token_id for t in s(logits.clone(), rows)]
        assert set(ids) == {0}, (top_k, torch.bincount(torch.tensor(ids), minlength=5))
    # the order of min-p and top-k does not matter (both keep the largest weights)
    rows = [SampleSpec("k", SamplingParams(temperature=1.0, min_p=0.7, top_k=1), 0, ())] * 200
    assert {t.token_id for t in make(5, 12)(logits[:200].clone(), rows)} == {0}

"""One request's failure is its own: the engine fails it alone and goes on serving the others;
only a failed forward pass or a broken invariant stops the engine (and then every caller hears
of it at once, with an ENGINE failure)."""

from __future__ import annotations

import threading
import time

import pytest

from shared.engine import InvalidRequestError
from shared.engine.connector import RemoteDecodeParams, RemotePrefillParams
from shared.engine.outputs import FailureKind
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams, SamplingParamsError
from shared.engine.scheduler_output import SampledToken, SampleError, SampleSpec
from shared.worker.engine_loop import EngineDeadError, EngineLoop
from tests.engine.fakes import fake_engine

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(engine, max_steps=200):
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        outs += engine.step()
        engine.check_integrity()
    return outs


def _tokens(outs, rid):
    return [t for o in outs if o.request_id == rid for t in o.new_token_ids]


# ---- validation -----------------------------------------------------------------------------


def test_the_wave1_request_is_refused_naming_the_seed(tmp_path):
    # n=2 with seed 2^63-1: sample 1 would draw with seed 2^63, which overflowed struct.pack on
    # the engine thread and stopped the engine for everyone
    e = fake_engine(tmp_path)
    with pytest.raises(SamplingParamsError, match="seed") as info:
        SamplingParams(n=2, seed=2**63 - 1, temperature=1, max_tokens=4)
    assert info.value.param == "seed"
    params = SamplingParams(n=2, seed=0, temperature=1, max_tokens=4)
    params.seed = 2**63 - 1  # changed after construction: add_request validates again
    with pytest.raises(InvalidRequestError, match="seed") as info:
        e.add_request("x", [5, 6], params)
    assert info.value.param == "seed"
    e.add_request("ok", [5, 6], SamplingParams(n=2, seed=2**63 - 2, temperature=1, max_tokens=4))
    assert len(_tokens(_run(e), "ok")) == 8


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(min_p=float("-inf")), "min_p"),
        (dict(seed=2**63), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(n=0), "n"),
        (dict(n=10**6), "n"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.0), "top_k"),
        (dict(top_k=2**63), "top_k"),  # the offline API's: the sampler's int64 tensor overflowed
        (dict(top_k=2**31), "top_k"),  # above int32, the wire's type
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=list(range(5000))), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_sampling_params_refuse_bad_values_naming_them(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


@pytest.mark.parametrize(
    "prompt, kwargs, param",
    [
        ([5, 97], {}, "prompt"),  # vocab is 97
        ([5, -1], {}, "prompt"),
        ([5, True], {}, "prompt"),
        ([5, 6], dict(params=SamplingParams(stop_token_ids=[500], min_tokens=1)), "stop_token_ids"),
        ([5, 6], dict(params=SamplingParams(logprobs=21)), "logprobs"),  # --max-logprobs 20
        ([5, 6], dict(resume=[[1, 2], [3]]), "resume"),  # n=1
        ([5, 6], dict(resume=[[1, 400]]), "resume"),
        ([5, 6], dict(resume=[list(range(3, 60))]), "resume"),  # nothing left to generate
        ([5, 6], dict(kv_transfer=RemoteDecodeParams(1)), "first_block_index"),  # 1 block only
        ([5, 6], dict(kv_transfer=RemotePrefillParams()), "kv_transfer"),  # a prefill engine
    ],
)
def test_engine_refuses_bad_requests_and_keeps_serving(tmp_path, prompt, kwargs, param):
    e = fake_engine(tmp_path, role="prefill")
    params = kwargs.pop("params", GREEDY)
    e.add_request("before", [7, 8, 9], GREEDY)
    with pytest.raises(InvalidRequestError) as info:
        e.add_request("bad", prompt, params, **kwargs)
    assert info.value.param == param
    e.add_request("after", [7, 8, 9], GREEDY)
    outs = _run(e)
    assert _tokens(outs, "before") == _tokens(outs, "after") and len(_tokens(outs, "after")) == 6
    assert "bad" not in e.parents


def test_the_largest_top_k_keeps_every_token():
    import torch

    from kernels import cpu_paged

    kernels = [None, cpu_paged.cut_rows] if cpu_paged.available() else [None]
    for cut_rows in kernels:
        s = Sampler(
            vocab_size=50,
            device=torch.device("cpu"),
            seed=0,
            race_rows=cpu_paged.race_rows if cut_rows else None,
            cut_rows=cut_rows,
        )
        rows = [SampleSpec("r", SamplingParams(temperature=1.0, top_k=2**31 - 1), 0, ())] * 3
        out = s(torch.randn(3, 50), rows)
        assert all(isinstance(t, SampledToken) and 0 <= t.token_id < 50 for t in out)
        assert bool((s.processed_probs(torch.randn(1, 50), rows[:1]) > 0).all())


def test_sampler_never_raises_for_extreme_seeds():
    import torch

    s = Sampler(vocab_size=50, device=torch.device("cpu"), seed=0)
    rows = [
        SampleSpec("r", SamplingParams(temperature=1.0, seed=seed), 0, ())
        for seed in (2**63 - 1, -(2**63), 0)
    ]
    out = s(torch.randn(3, 50), rows)
    assert all(isinstance(t, SampledToken) and 0 <= t.token_id < 50 for t in out)


def test_a_row_that_fails_in_the_sampler_fails_alone(monkeypatch):
    import torch

    s = Sampler(vocab_size=50, device=torch.device("cpu"), seed=0)
    real = s._sample_batch

    def flaky(logits, rows):
        if any(r.seq_id == "bad" for r in rows):
            raise RuntimeError("boom")
        return real(logits, rows)

    monkeypatch.setattr(s, "_sample_batch", flaky)
    logits = torch.randn(3, 50)
    rows = [SampleSpec(rid, SamplingParams(temperature=0), 0, ()) for rid in ("a", "bad", "c")]
    out = s(logits, rows)
    assert isinstance(out[1], SampleError) and "boom" in out[1].reason
    assert [out[0].token_id, out[2].token_id] == logits[[0, 2]].argmax(-1).tolist()


# ---- per-request failures in a step --------------------------------------------------------


def test_a_sampling_failure_fails_that_request_alone(tmp_path):
    e = fake_engine(tmp_path)
    for rid in ("a", "b", "c"):
        e.add_request(rid, [11, 12, 13], GREEDY)
    e.runner.fail_sampling.add("b")
    outs = _run(e)
    failed = [o for o in outs if o.request_id == "b" and o.finished]
    assert len(failed) == 1 and failed[0].finish_reason == "error"
    assert failed[0].failure.kind is FailureKind.REQUEST and "injected" in failed[0].failure.message
    assert len(_tokens(outs, "a")) == len(_tokens(outs, "c")) == 6
    assert _tokens(outs, "a") == _tokens(outs, "c")
    assert e.kv.pool.num_free_blocks == e.num_blocks  # nothing leaked
    e.add_request("b", [11, 12, 13], GREEDY)  # the id is free again; the engine still serves
    e.runner.fail_sampling.clear()
    assert _tokens(_run(e), "b") == _tokens(outs, "a")


def test_a_failing_sibling_fails_its_whole_parent(tmp_path):
    e = fake_engine(tmp_path)
    e.add_request(
        "par", [11, 12, 13], SamplingParams(n=3, temperature=0, max_tokens=5, ignore_eos=True)
    )
    e.add_request("other", [11, 12, 13], GREEDY)
    e.runner.fail_sampling.add("2_par")  # the third sample, at the fork
    outs = _run(e)
    ends = {o.index: o.finish_reason for o in outs if o.request_id == "par" and o.finished}
    assert ends == {0: "error", 1: "error", 2: "error"}
    assert len(_tokens(outs, "other")) == 6
    assert e.kv.pool.num_free_blocks == e.num_blocks and "par" not in e.parents


def test_an_exception_in_a_request_update_fails_only_that_request(tmp_path, monkeypatch):
    e = fake_engine(tmp_path)
    e.add_request("a", [11, 12, 13], GREEDY)
    e.add_request("b", [21, 22, 23], GREEDY)
    sched = e.scheduler
    real = sched._check_stop

    def check_stop(req, token):
        if req.request_id == "b" and req.num_output_tokens == 3:
            raise ValueError("stop handling broke")
        return real(req, token)

    monkeypatch.setattr(sched, "_check_stop", check_stop)
    outs = _run(e)
    (end_b,) = [o for o in outs if o.request_id == "b" and o.finished]
    assert end_b.finish_reason == "error" and "stop handling broke" in end_b.failure.message
    assert len(_tokens(outs, "a")) == 6
    assert e.kv.pool.num_free_blocks == e.num_blocks


def test_a_failure_that_breaks_an_invariant_stops_the_engine(tmp_path, monkeypatch):
    from shared.engine.block_pool import IntegrityError

    e = fake_engine(tmp_path)
    e.add_request("a", [11, 12, 13], GREEDY)
    e.runner.fail_sampling.add("a")
    monkeypatch.setattr(e.kv, "free", lambda req: None)  # the failure path leaks: a bug
    with pytest.raises(IntegrityError):
        _run(e)


# ---- the loop -------------------------------------------------------------------------------


def _wait(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_a_sink_that_raises_fails_its_request_and_the_loop_goes_on(tmp_path):
    e = fake_engine(tmp_path)
    loop = EngineLoop(e)
    got: dict[str, list] = {"good": [], "bad": []}
    done = threading.Event()

    def good(o):
        got["good"].append(o)
        if o.finished:
            done.set()

    def bad(o):
        got["bad"].append(o)
        if not o.finished:
            raise RuntimeError("consumer broke")

    loop.add_sink("good", good)
    loop.add_sink("bad", bad)
    loop.start()
    try:
        loop.submit(lambda eng: eng.add_request("bad", [5, 6, 7], GREEDY)).result(5)
        loop.submit(lambda eng: eng.add_request("good", [5, 6, 7], GREEDY)).result(5)
        assert done.wait(10)
        assert _wait(lambda: got["bad"] and got["bad"][-1].finished)
        last = got["bad"][-1]
        assert last.finish_reason == "error" and "consumer broke" in last.failure.message
        assert sum(len(o.new_token_ids) for o in got["good"]) == 6
        assert loop.alive
        assert loop.submit(lambda eng: eng.kv.pool.num_free_blocks).result(5) == e.num_blocks
    finally:
        loop.stop()


def test_a_failed_forward_pass_is_fatal_and_ends_every_stream(tmp_path):
    e = fake_engine(tmp_path)
    fatal: list[BaseException] = []
    loop = EngineLoop(e, on_fatal=fatal.append)
    seen: list = []
    loop.add_sink("a", seen.append)
    loop.start()
    try:
        e.runner.fail_forward = True
        loop.submit(lambda eng: eng.add_request("a", [5, 6, 7], GREEDY)).result(5)
        assert _wait(lambda: fatal)
        assert not loop.alive and "forward" in str(fatal[0])
        assert seen and seen[-1].failure.kind is FailureKind.ENGINE
        with pytest.raises(EngineDeadError):
            loop.submit(lambda eng: None).result(5)
    finally:
        loop.stop()


def test_the_worker_learns_of_the_engines_death_even_when_ending_the_streams_fails(tmp_path):
    """Ending the open streams after a fatal step ran before ``on_fatal`` with nothing between:
    an exception there (a batch sink that raised, or the streams' dict changing size while it
    was read, which the event loop's thread does) skipped ``on_fatal``: the worker never exited
    and stayed registered with a dead engine."""

    class BrokenBatchSink:
        queues = {"a": None}

        def __call__(self, outputs):
            raise RuntimeError("sink broke")

    e = fake_engine(tmp_path)
    fatal: list[BaseException] = []
    loop = EngineLoop(e, on_fatal=fatal.append)
    loop.add_batch_sink(BrokenBatchSink())  # type: ignore[arg-type]
    seen: list = []
    loop.add_sink("b", seen.append)
    loop.start()
    try:
        e.runner.fail_forward = True
        loop.submit(lambda eng: eng.add_request("b", [5, 6, 7], GREEDY)).result(5)
        assert _wait(lambda: fatal)
        assert "forward" in str(fatal[0]) and seen and seen[-1].finish_reason == "error"
    finally:
        loop.stop()


# ---- failover exactness for every sample -----------------------------------------------------


def test_a_resumed_request_does_not_continue_samples_that_already_ended(tmp_path):
    e = fake_engine(tmp_path)
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    e.add_request("r", [5, 6, 7], params, resume=[[9, 9], [8], [7, 7, 7]], resume_finished={0})
    outs = _run(e)
    assert {o.index for o in outs} == {1, 2}  # nothing for sample 0
    per = {i: [t for o in outs if o.index == i for t in o.new_token_ids] for i in (1, 2)}
    assert len(per[1]) == 5 and len(per[2]) == 3  # each continued up to max_tokens
    assert e.kv.pool.num_free_blocks == e.num_blocks and "r" not in e.parents


def test_a_finished_samples_resume_tokens_are_bounded_by_max_tokens(tmp_path):
    """Only unfinished samples' resume tokens were bounded: a finished one's (4M tokens in a
    3 MiB message) were checked one by one on the engine thread (review)."""
    e = fake_engine(tmp_path)
    params = SamplingParams(n=2, temperature=0, max_tokens=6)
    with pytest.raises(InvalidRequestError, match="finished sample 0") as err:
        e.add_request("r", [5, 6], params, resume=[[1] * 7, [2]], resume_finished={0})
    assert err.value.param == "resume"
    e.add_request("ok", [5, 6], params, resume=[[1] * 6, [2]], resume_finished={0})


def test_resume_finished_must_leave_something_to_do(tmp_path):
    e = fake_engine(tmp_path)
    params = SamplingParams(n=2, temperature=0, max_tokens=6)
    with pytest.raises(InvalidRequestError, match="resume_finished"):
        e.add_request("r", [5, 6], params, resume=[[1], [2]], resume_finished={0, 1})


def test_abort_samples_ends_only_those(tmp_path):
    e = fake_engine(tmp_path)
    e.add_request(
        "p", [5, 6, 7], SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    )
    outs = e.step()  # the first token forks the samples
    assert {o.index for o in outs} == {0, 1, 2}
    ended = e.abort_samples("p", [1])
    assert [(o.index, o.finish_reason) for o in ended] == [(1, "abort")]
    outs = _run(e)
    counts = {i: sum(len(o.new_token_ids) for o in outs if o.index == i) for i in (0, 1, 2)}
    assert counts == {0: 19, 1: 0, 2: 19}
    assert e.kv.pool.num_free_blocks == e.num_blocks

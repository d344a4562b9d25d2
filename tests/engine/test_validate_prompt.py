"""``EngineCore.validate_prompt``: add_request's own checks of the prompt and the sampling (the
same exception types, messages and params: one implementation), queueing nothing and reading
nothing of the engine's state, so that the services can run it on their event loop, before
their admission check, while the engine thread steps."""

from __future__ import annotations

import pytest

from shared.engine import InvalidRequestError, PromptTooLongError
from shared.engine.sampling_params import SamplingParams
from tests.engine.fakes import fake_engine

pytestmark = pytest.mark.unit

VOCAB = 97
MAX_LEN = 64

Bad, TooLong = InvalidRequestError, PromptTooLongError
# (prompt, sampling params, exception type, param): each refused by add_request
BAD = {
    "too-long": ([5] * MAX_LEN, None, TooLong, "prompt"),
    "far-too-long": (list(range(10 * MAX_LEN)), None, TooLong, "prompt"),
    "empty": ([], None, Bad, "prompt"),
    "not-a-list": ("hello", None, Bad, "prompt"),
    "not-a-sequence": ({5, 6}, None, Bad, "prompt"),
    "out-of-vocab": ([5, 6, VOCAB + 7, VOCAB + 9], None, Bad, "prompt"),
    "at-vocab": ([5, VOCAB], None, Bad, "prompt"),
    "negative": ([5, -1], None, Bad, "prompt"),
    "float": ([5, 6.0], None, Bad, "prompt"),
    "bool": ([5, True], None, Bad, "prompt"),
    "str-id": ([5, "6"], None, Bad, "prompt"),
    "stop-token-id": ([5, 6], dict(stop_token_ids=[VOCAB]), Bad, "stop_token_ids"),
    "logit-bias": ([5, 6], dict(logit_bias={3: 1.0, VOCAB: 1.0}), Bad, "logit_bias"),
    "allowed": ([5, 6], dict(allowed_token_ids=[3, VOCAB]), Bad, "allowed_token_ids"),
    "logprobs": ([5, 6], dict(logprobs=VOCAB + 1), Bad, "logprobs"),
    "prompt-logprobs": ([5, 6], dict(prompt_logprobs=VOCAB + 1), Bad, "prompt_logprobs"),
    "max-logprobs": ([5, 6], dict(logprobs=21), Bad, "logprobs"),  # (--max-logprobs 20)
}


def _params(kw):
    return SamplingParams(temperature=0, max_tokens=4, **(kw or {}))


def _state(e):
    sch = e.scheduler
    return (
        dict(e.parents),
        sch.num_waiting,
        len(sch.running),
        len(sch.waiting),
        len(sch.swapped),
        e.has_unfinished_requests(),
        dict(e.hash_seeds),
    )


@pytest.mark.parametrize("case", list(BAD))
def test_validate_prompt_raises_what_add_request_raises_and_queues_nothing(tmp_path, case):
    prompt, kw, exc, param = BAD[case]
    e = fake_engine(tmp_path, vocab=VOCAB, max_model_len=MAX_LEN, max_logprobs=20)
    e.add_request("before", [7, 8, 9], _params(None))  # something queued already
    before = _state(e)
    params = _params(kw)
    with pytest.raises(InvalidRequestError) as by_validate:
        e.validate_prompt(prompt, params)
    assert _state(e) == before
    with pytest.raises(InvalidRequestError) as by_add:
        e.add_request("bad", prompt, params)
    assert _state(e) == before, "a refused request must leave nothing queued"
    v, a = by_validate.value, by_add.value
    assert type(v) is type(a) is exc
    assert (str(v), v.param) == (str(a), a.param) and v.param == param
    if kw is None:  # a prompt's error: found without sampling params too
        with pytest.raises(exc) as alone:
            e.validate_prompt(prompt)
        assert (str(alone.value), alone.value.param) == (str(a), a.param)


def test_validate_prompt_messages(tmp_path):
    """The messages the services answer INVALID_ARGUMENT with (tested there too)."""
    e = fake_engine(tmp_path, vocab=VOCAB, max_model_len=MAX_LEN)
    with pytest.raises(PromptTooLongError) as err:
        e.validate_prompt([5] * 70)
    assert str(err.value) == (
        "prompt has 70 tokens; the model's maximum context length is 64 "
        "(prompt + at least one output token must fit)"
    )
    with pytest.raises(InvalidRequestError) as err:
        e.validate_prompt([5, 6, VOCAB + 7, VOCAB + 9])  # the first bad id is named
    assert str(err.value) == f"prompt: token ids must be in [0, {VOCAB}), got {VOCAB + 7}"
    with pytest.raises(InvalidRequestError) as err:
        e.validate_prompt([5, -3])
    assert str(err.value) == f"prompt: token ids must be in [0, {VOCAB}), got -3"
    with pytest.raises(InvalidRequestError) as err:
        e.validate_prompt([5, 6], "greedy")
    assert (str(err.value), err.value.param) == ("params must be SamplingParams", "sampling_params")


def test_a_valid_request_passes_and_the_caller_params_are_left_as_they_were(tmp_path):
    e = fake_engine(tmp_path, vocab=VOCAB, max_model_len=MAX_LEN)
    before = _state(e)
    params = SamplingParams(temperature=0, max_tokens=1000, min_tokens=900, logit_bias={96: 1.0})
    assert e.validate_prompt([0, 5, VOCAB - 1], params) is None
    assert e.validate_prompt(list(range(MAX_LEN - 1))) is None  # the longest that fits
    assert e.validate_prompt((5, 6)) is None  # any sequence of ids
    # max_tokens past the context is no error (add_request lowers it, in its own copy)
    assert (params.max_tokens, params.min_tokens) == (1000, 900)
    assert _state(e) == before
    e.add_request("ok", [0, 5, VOCAB - 1], params)
    while e.has_unfinished_requests():
        e.step()


class _Untouchable:
    """Engine state the validation must not read (it runs beside the engine thread)."""

    def __getattr__(self, name):
        raise AssertionError(f"validate_prompt read engine state ({name})")

    def __contains__(self, item):
        raise AssertionError("validate_prompt read engine state (in)")

    def __len__(self):
        raise AssertionError("validate_prompt read engine state (len)")

    def __iter__(self):
        raise AssertionError("validate_prompt read engine state (iter)")


def test_validate_prompt_reads_no_engine_state(tmp_path):
    e = fake_engine(tmp_path, vocab=VOCAB, max_model_len=MAX_LEN)
    for name in ("scheduler", "parents", "hash_seeds", "connector", "kv", "runner", "_grammars"):
        assert hasattr(e, name), name
        setattr(e, name, _Untouchable())
    e.validate_prompt([5, 6, 7], SamplingParams(logit_bias={3: 1.0}, allowed_token_ids=[3, 4]))
    for prompt, kw, exc, _ in BAD.values():
        with pytest.raises(exc):
            e.validate_prompt(prompt, _params(kw))

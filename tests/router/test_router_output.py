"""Stop strings, hold-backs and token accounting of ``router/output.py``."""

from __future__ import annotations

import pytest

from router.output import OutputParams, SampleOutput
from router.tokenizer import RouterTokenizer
from shared.proto import pdserve_pb2 as pb

EOS = 1


@pytest.fixture(scope="module")
def tok(tiny_model) -> RouterTokenizer:
    return RouterTokenizer.from_model_dir(tiny_model)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(tok, tokens, params, per_delta=1, finish="length"):
    """Feed ``tokens`` in deltas of ``per_delta``; returns (sample, streamed text)."""
    s = SampleOutput(0, tok, params)
    streamed = []
    for i in range(0, len(tokens), per_delta):
        last = i + per_delta >= len(tokens)
        s.add(tokens[i : i + per_delta], finish_reason=finish if last else "")
        if (d := s.take()) is not None:
            streamed.append(d.text)
        if s.finished:
            break
    return s, "".join(streamed)


def test_plain_text_streams_whole(tok):
    t = ids(tok, "the quick brown fox")
    s, streamed = run(tok, t, OutputParams())
    assert s.text == streamed == "the quick brown fox"
    assert s.token_ids == t and s.finish_reason == "length"


def test_stop_string_across_tokens_truncates_and_drops_later_tokens(tok):
    text = "one two three four five six"
    t = ids(tok, text)
    s, streamed = run(tok, t, OutputParams(stop=("ee fo",)), per_delta=3)
    assert s.text == streamed == "one two thr"
    assert (s.finish_reason, s.stop_reason) == ("stop", "ee fo")
    # counted up to the token that completed the match, not beyond
    n = next(k for k in range(1, len(t) + 1) if "ee fo" in tok.decode(t[:k]))
    assert s.token_ids == t[:n]


def test_stop_string_included_when_asked(tok):
    t = ids(tok, "alpha beta gamma delta")
    s, streamed = run(tok, t, OutputParams(stop=("gamma",), include_stop_str_in_output=True))
    assert s.text == streamed == "alpha beta gamma"


def test_partial_stop_string_is_held_back_while_streaming(tok):
    t = ids(tok, "abc STO") + ids(tok, "P more")
    s = SampleOutput(0, tok, OutputParams(stop=("STOP",)))
    s.add(ids(tok, "abc STO"))
    d = s.take()
    assert d is not None and "STO" not in d.text  # could still become the stop string
    s.add(ids(tok, "P more"))
    assert s.text == "abc " and s.finish_reason == "stop"
    assert t[: len(s.token_ids)] == s.token_ids


def test_earliest_stop_string_wins(tok):
    t = ids(tok, "x y z w")
    s, _ = run(tok, t, OutputParams(stop=(" w", " y")), per_delta=len(t))
    assert s.text == "x" and s.stop_reason == " y"


def test_min_tokens_defers_stop_strings(tok):
    t = ids(tok, "stop here and then stop again")
    s, _ = run(tok, t, OutputParams(stop=("stop",), min_tokens=3))
    assert s.text == "stop here and then " and s.stop_reason == "stop"


def test_eos_is_counted_but_not_shown_and_held_until_known(tok):
    body = ids(tok, "hello there")
    s = SampleOutput(0, tok, OutputParams(terminal_ids=frozenset({EOS}), skip_special_tokens=False))
    s.add(body + [EOS])  # EOS at the end of a delta, no finish yet: held back
    assert s.take().text == "hello there"
    s.add([], finish_reason="stop")
    d = s.take()
    assert d.finish_reason == "stop" and d.text == "" and s.stop_reason is None
    assert s.text == "hello there" and s.token_ids == body + [EOS]


def test_held_terminal_token_is_shown_when_generation_continues(tok):
    s = SampleOutput(0, tok, OutputParams(terminal_ids=frozenset({EOS}), skip_special_tokens=False))
    s.add(ids(tok, "a") + [EOS])  # ignore_eos-like: the engine goes on
    s.add(ids(tok, " b"), finish_reason="length")
    assert s.text == "a</s> b"


def test_stop_token_id_reports_stop_reason(tok):
    t = ids(tok, "red green blue")
    stop_id = t[1]
    s = SampleOutput(
        0,
        tok,
        OutputParams(stop_token_ids=frozenset({stop_id}), terminal_ids=frozenset({stop_id, EOS})),
    )
    s.add(t[:2], finish_reason="stop", stop_token_id=stop_id)
    assert s.text == "red" and s.stop_reason == stop_id and s.token_ids == t[:2]


def test_split_utf8_never_streams_replacement_char(tok):
    t = ids(tok, "日本語😀")
    s, streamed = run(tok, t, OutputParams())
    assert s.text == streamed and s.finish_reason == "length"
    assert streamed == "日本語😀" and "\ufffd" not in streamed


def test_logprobs_and_offsets_follow_tokens(tok):
    t = ids(tok, "one two")
    lps = [pb.TokenLogprob(logprob=-0.5 * (i + 1), rank=1) for i in range(len(t))]
    s = SampleOutput(0, tok, OutputParams(logprobs=0))
    s.add(t, lps, finish_reason="length")
    d = s.take()
    assert [e.token_id for e in d.tokens] == t
    assert [e.logprob.logprob for e in d.tokens] == [x.logprob for x in lps]
    offsets = [e.text_offset for e in d.tokens]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(s.text)
    assert s.take() is None  # nothing new, finish already reported


def _sentencepiece_tokenizer() -> RouterTokenizer:
    """A tokenizer with the decoder of Llama 2's and Mistral 7B v0.1's ``tokenizer.json``
    (Metaspace pieces; ``Strip`` removes the text's first space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁of": 5}
    vocab |= {"▁France": 6, "▁is": 7, "▁Paris": 8, ".": 9, "<0xC3>": 10, "<0xA9>": 11}
    t = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix=""))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return RouterTokenizer(t, {"eos_token": "</s>", "bos_token": "<s>"}, None)


def test_the_first_tokens_space_survives_a_sentencepiece_decoder():
    # An unprimed stream decoded "▁Paris" as "Paris": completions lost the space vLLM keeps
    # (its detokenizer primes the stream with the prompt's tail), and a stop string " Paris"
    # never matched (found by review, 2026-12-06).
    sp = _sentencepiece_tokenizer()
    prompt, output = [1, 3, 4, 5, 6, 7], [8, 9]  # "The capital of France is" -> " Paris."
    want = sp.decode(prompt + output)[len(sp.decode(prompt)) :]
    assert want == " Paris."
    s = SampleOutput(0, sp, OutputParams(), sp.prompt_tail(prompt))
    for t in output:
        s.add([t])
    s.add([], finish_reason="length")
    assert s.text == want
    s = SampleOutput(0, sp, OutputParams(stop=(" Paris",)), sp.prompt_tail(prompt))
    for t in output:
        s.add([t])
    assert (s.finish_reason, s.stop_reason, s.text) == ("stop", " Paris", "")


def test_the_prompt_tail_starts_on_a_whole_character():
    sp = _sentencepiece_tokenizer()
    # the last 4 tokens begin with the second byte of "é": the tail takes one token more
    prompt = [3, 4, 5, 10, 11, 6, 7, 8]
    assert sp.prompt_tail(prompt) == [10, 11, 6, 7, 8]
    assert sp.prompt_tail([3, 4]) == [3, 4]
    s = SampleOutput(0, sp, OutputParams(), sp.prompt_tail([3, 10]))  # ends mid-character
    s.add([11])
    s.add([9])
    assert s.text == "é."


def test_priming_leaves_byte_level_text_as_it_was(tok):
    prompt, output = ids(tok, "The answer is"), ids(tok, " 42, surely é!")
    plain = run(tok, output, OutputParams())[0].text
    s = SampleOutput(0, tok, OutputParams(), tok.prompt_tail(prompt))
    for t in output:
        s.add([t])
    assert s.text == plain == " 42, surely é!"


@pytest.mark.parametrize("min_tokens, stops", [(3, True), (4, False), (0, True)])
def test_the_first_min_tokens_tokens_text_is_never_searched_for_a_stop_string(
    tok, min_tokens, stops
):
    # vLLM v1's rule (its detokenizer, PR 22014): a stop string completed by the
    # min_tokens-th token does not stop the sample; the router used to stop there
    tokens = ids(tok, "hello world again")
    assert [tok.decode([t]) for t in tokens][3] == " world"  # the 4th token completes it
    s = SampleOutput(0, tok, OutputParams(stop=(" world",), min_tokens=min_tokens))
    for t in tokens:
        s.add([t])
    if stops:
        assert (s.finish_reason, s.stop_reason, s.text) == ("stop", " world", "hello")
    else:
        assert s.finish_reason is None and s.text == "hello world again"

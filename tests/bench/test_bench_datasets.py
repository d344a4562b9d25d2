"""Dataset generators: exact token counts, shared prefixes, length distributions, seeds."""

from __future__ import annotations

import numpy as np
import pytest

from bench import datasets as ds
from bench.tokenizer import BenchTokenizer, TokenizerError


@pytest.fixture(scope="module")
def tok(bench_model) -> BenchTokenizer:
    return BenchTokenizer.from_dir(bench_model)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_tokenizer_adds_bos_like_the_server(tok):
    assert tok.num_special_tokens_to_add == 1
    assert tok.encode("hello world")[0] == 0  # <s>
    assert tok.count("hello world") == tok.count("hello world", add_special_tokens=False) + 1


def test_tokenizer_bad_dir_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="not a directory"):
        BenchTokenizer.from_dir(tmp_path / "missing")
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json|cannot load"):
        BenchTokenizer.from_dir(tmp_path)


def test_chat_template_count_and_fallback(tok, bench_model):
    msgs = [{"role": "user", "content": "hello there"}]
    text = tok.render_chat(msgs)
    assert text == "<s><|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.count_chat(msgs) == tok.count(text, add_special_tokens=False)
    broken = BenchTokenizer.from_dir(bench_model)
    broken.chat_template = "{{ raise_exception('unsupported role') }}"
    assert broken.count_chat(msgs) is None  # the caller keeps its own estimate


@pytest.mark.parametrize("input_len", [1, 2, 7, 256, 1000])
def test_random_prompts_are_exactly_n_tokens(tok, input_len):
    sessions, stats = ds.random_dataset(tok, _rng(input_len), 24, input_len, 16)
    assert stats.inexact_prompts == 0
    for s in sessions:
        (turn,) = s.turns
        assert turn.prompt_len == input_len
        assert len(tok.encode(turn.prompt)) == input_len  # what the server will count
        assert turn.output_len == 16


def test_random_range_ratio_bounds_and_spread(tok):
    sessions, stats = ds.random_dataset(tok, _rng(1), 200, 100, 40, range_ratio=0.5)
    ins = [s.turns[0].prompt_len for s in sessions]
    outs = [s.turns[0].output_len for s in sessions]
    assert stats.inexact_prompts == 0
    assert all(tok.count(s.turns[0].prompt) == s.turns[0].prompt_len for s in sessions)
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 30
    assert min(outs) >= 20 and max(outs) <= 60 and len(set(outs)) > 15


def test_random_prefix_len_shares_one_prefix(tok):
    sessions, _ = ds.random_dataset(tok, _rng(2), 10, 50, 8, prefix_len=64)
    ids = [tok.encode(s.turns[0].prompt) for s in sessions]
    assert all(len(i) == 64 + 50 for i in ids)
    assert all(i[:65] == ids[0][:65] for i in ids)  # BOS + 64 prefix tokens
    assert len({tuple(i[65:]) for i in ids}) == 10


def test_seed_reproduces_and_changes_prompts(tok):
    a, _ = ds.random_dataset(tok, _rng(7), 5, 64, 8, range_ratio=0.3)
    b, _ = ds.random_dataset(tok, _rng(7), 5, 64, 8, range_ratio=0.3)
    c, _ = ds.random_dataset(tok, _rng(8), 5, 64, 8, range_ratio=0.3)
    assert a == b
    assert [s.turns[0].prompt for s in a] != [s.turns[0].prompt for s in c]


def test_prefix_repetition_really_shares_prefixes(tok):
    sessions, stats = ds.prefix_repetition_dataset(
        tok, _rng(3), 40, prefix_len=128, suffix_len=32, num_prefixes=4, output_len=8
    )
    assert stats.inexact_prompts == 0 and stats.prefix_mismatches == 0
    by_group: dict[int, list[list[int]]] = {}
    for s in sessions:
        ids = tok.encode(s.turns[0].prompt)
        assert len(ids) == s.turns[0].prompt_len == 128 + 32
        by_group.setdefault(s.group, []).append(ids)
    assert sorted(by_group) == [0, 1, 2, 3] and all(len(v) == 10 for v in by_group.values())
    heads = []
    for group in by_group.values():
        head = group[0][:129]  # BOS + 128 prefix tokens, identical token ids in the group
        assert all(ids[:129] == head for ids in group)
        assert len({tuple(ids[129:]) for ids in group}) == len(group)  # unique suffixes
        heads.append(tuple(head))
    assert len(set(heads)) == 4
    assert [s.group for s in sessions] != sorted(s.group for s in sessions)  # shuffled


def test_sharegpt_lengths_follow_the_stated_distribution(tok):
    # A narrow log-normal must centre on the given means (the generator's parametrisation).
    sessions, stats = ds.sharegpt_dataset(
        tok, _rng(4), 150, input_mean=120, output_mean=60, sigma=0.05
    )
    ins = np.array([s.turns[0].prompt_len for s in sessions])
    outs = np.array([s.turns[0].output_len for s in sessions])
    assert stats.inexact_prompts == 0
    assert abs(ins.mean() - 120) < 4 and abs(outs.mean() - 60) < 2
    assert all(tok.count(s.turns[0].prompt) == s.turns[0].prompt_len for s in sessions)


def test_sharegpt_defaults_obey_the_filter(tok):
    sessions, _ = ds.sharegpt_dataset(tok, _rng(5), 300)
    ins = np.array([s.turns[0].prompt_len for s in sessions])
    outs = np.array([s.turns[0].output_len for s in sessions])
    assert ins.min() >= 4 and outs.min() >= 4 and ins.max() <= 1024
    assert (ins + outs).max() <= 2048
    assert np.std(np.log(ins)) > 0.6  # heavy-tailed, not a constant length
    assert 80 < np.median(ins) < 160 and 150 < np.median(outs) < 330


def test_multi_turn_turn_lengths_and_system(tok):
    sessions, _ = ds.multi_turn_dataset(
        tok, _rng(6), 3, turns=4, input_len=40, output_len=12, system_len=20
    )
    assert len(sessions) == 3 and all(len(s.turns) == 4 for s in sessions)
    assert all(s.system == sessions[0].system for s in sessions)
    assert tok.count(sessions[0].system, add_special_tokens=False) == 20
    for s in sessions:
        for t in s.turns:
            assert tok.count(t.prompt, add_special_tokens=False) == t.prompt_len == 40
            assert t.output_len == 12


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num": 0, "input_len": 10, "output_len": 4}, "num_prompts"),
        ({"num": 2, "input_len": 10, "output_len": 0}, "output_len"),
        ({"num": 2, "input_len": 10, "output_len": 4, "range_ratio": 1.0}, "range ratio"),
    ],
)
def test_bad_dataset_parameters_raise(tok, kwargs, match):
    with pytest.raises(ds.DatasetError, match=match):
        ds.random_dataset(tok, _rng(), **kwargs)

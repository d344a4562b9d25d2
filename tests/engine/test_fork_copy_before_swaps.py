"""A fork's block copy runs before the step's swaps (``ModelRunner._move_blocks``).

The copy that gives an ``n > 1`` sibling its own copy of the leader's partly filled prompt block
is scheduled with the fork and runs in the next step. That step may swap the sibling out at
once (the copy's destination) or swap another sequence into the leader's block, when the leader
finished on its first token and freed it (the copy's source). Swaps before the copy kept a
never-written block on the host, or copied the other sequence's KV into the sibling: wrong
tokens, silently, on the real runner (found by review, 2026-12-06)."""

from __future__ import annotations

import torch

from shared.config import EngineArgs
from shared.engine import EngineCore
from shared.engine.connector import RemotePrefillParams
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SampledToken
from tests.engine.fakes import fake_engine


def _runner(tiny_llama):
    e = EngineCore(
        EngineArgs(
            model=str(tiny_llama),
            num_gpu_blocks_override=8,
            max_model_len=64,
            preemption_mode="swap",
            swap_space=0.002,
        )
    )
    r = e.runner
    assert r.kv_cache is not None and r.host_cache is not None
    kv = r.kv_cache.view(torch.uint8)
    for b in range(kv.shape[0]):
        kv[b] = b + 1  # every block tells which it is
    return r, kv, r.host_cache.view(torch.uint8)


def test_a_copys_destination_swapped_out_in_the_same_step_leaves_with_the_copy(tiny_llama):
    r, kv, host = _runner(tiny_llama)
    r._move_blocks([(3, 0)], [], [(2, 3)])  # copy 2 -> 3, then 3 goes to host block 0
    assert torch.all(host[0] == 3), "the host holds block 3 from before its copy"
    assert torch.all(kv[3] == 3)


def test_a_copys_source_swapped_into_in_the_same_step_is_read_first(tiny_llama):
    r, kv, host = _runner(tiny_llama)
    host[1] = 99
    r._move_blocks([], [(1, 3)], [(3, 1)])  # copy 3 -> 1, then host block 1 comes into 3
    assert torch.all(kv[1] == 4), "the copy read the block swapped in, not the leader's"
    assert torch.all(kv[3] == 99)


def _small_engine(tmp_path, num_blocks, mode, role="none"):
    """A fake engine of 4-token blocks with a host pool for a block (swap mode)."""
    return fake_engine(
        tmp_path / f"{mode}{num_blocks}",
        num_blocks=num_blocks,
        role=role,
        block_size=4,
        max_model_len=16,
        preemption_mode=mode,
        swap_space=1e-5,
        enable_prefix_caching=False,
    )


def _tokens(e, feed=None):
    toks: dict[tuple[str, int], list[int]] = {}
    while e.has_unfinished_requests() or (feed is not None and feed.pending):
        for o in e.step():
            toks.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        e.check_integrity()
        if feed is not None:
            feed(e, toks)
    return toks


def test_a_sibling_preempted_right_after_its_fork_keeps_the_leaders_prompt(tmp_path):
    # X's second token needs a block when L's sibling has just forked: the newest, the sibling,
    # is swapped out in the step that runs its copy.
    def run(num_blocks, mode):
        e = _small_engine(tmp_path, num_blocks, mode)
        e.add_request("X", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True, seed=3))
        e.add_request(
            "L", [9, 10, 11, 12, 13, 14], SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=7)
        )
        toks = _tokens(e)
        return toks, e

    want, _ = run(16, "recompute")
    got, e = run(4, "swap")
    assert any(s.blocks_to_swap_out and s.blocks_to_copy for s in e.runner.steps), (
        "no step swapped out and copied together: the case went untested"
    )
    assert got == want


def test_a_block_freed_by_a_leaders_first_token_is_copied_before_it_is_reused(tmp_path):
    # L (n 2, remote prefill) stops on the prefill worker's first token; the sibling's copy of
    # L's prompt block is pending when the freed block takes a sequence swapped back in.
    stop, prompt = 11, [60, 61]

    class Feed:
        def __init__(self):
            self.job = None
            self.pending = False

        def __call__(self, e, toks):
            for j in e.take_remote_prefills():
                self.job, self.pending = j, True
                e.runner.write(list(j.block_ids), 0, prompt)  # the transfer, played
            if self.job is not None and "G" not in e.parents:
                for o in e.finish_remote_prefill("L", [SampledToken(stop), SampledToken(12)]):
                    toks.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
                e.unpin(self.job.pin_id)
                self.job, self.pending = None, False

    def run(num_blocks, mode):
        e = _small_engine(tmp_path, num_blocks, mode, role="decode")
        e.add_request("R", [20, 21, 22, 23], SamplingParams(max_tokens=8, ignore_eos=True, seed=1))
        e.add_request("G", [30], SamplingParams(max_tokens=2, ignore_eos=True, seed=2))
        e.add_request("F", [40], SamplingParams(max_tokens=6, ignore_eos=True, seed=3))
        sp = SamplingParams(n=2, max_tokens=4, ignore_eos=True, seed=4, stop_token_ids=[stop])
        e.add_request("L", prompt, sp, kv_transfer=RemotePrefillParams())
        feed = Feed()
        feed.pending = True
        return _tokens(e, feed), e

    want, _ = run(16, "recompute")
    got, e = run(4, "swap")
    assert any(s.blocks_to_swap_in and s.blocks_to_copy for s in e.runner.steps), (
        "no step swapped in and copied together: the case went untested"
    )
    assert got == want
    assert e.kv.pool.num_free_blocks == 4

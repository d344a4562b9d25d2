"""How far the engine's bf16 paths are from its fp32 path, on fixed random token sequences.

For each sequence (``--prompt-len`` + ``--new`` random tokens) the fp32 engine's logits at the
last ``--new`` positions (one prefill; the fp32 path is pinned token for token to
``transformers`` by the tests) are compared with the bf16 engine's, computed two ways:

* **prefill**: one prefill of the whole sequence (the prefill attention kernels, the linears at
  many rows);
* **decode**: a prefill of the prompt, then one decode step per token, teacher-forced (the
  decode step's one C++ call and decode attention, the linears at one row).

It prints each path's argmax agreement with fp32, the decode path's with the prefill path, and
the mean absolute logit error over the fp32 logits' standard deviation. The sequences are fixed
(``--seed``), so two builds (``git worktree`` at another commit) can be compared: a kernel that
rounds worse moves the error, while the engine's own greedy continuation (what the agreement
tests feed back) changes with any rounding. Usage::

    python bench/bf16_error.py [--model DIR] [--seqs 32] [--prompt-len 32] [--new 128]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.config import EngineArgs
from shared.engine.core import EngineCore
from tests.engine.helpers import fresh_cache, one_sequence_meta, prefill_logits

DEFAULT_MODEL = Path.home() / ".cache" / "pdserve" / "bench" / "small-llama"


def _runner(model: Path, **kw):
    args = EngineArgs(model=str(model), device="cpu", kv_cache_memory="32MiB", **kw)
    return EngineCore(args).runner


@torch.inference_mode()
def decode_logits(runner, toks: list[int], prompt_len: int) -> torch.Tensor:
    """Logits predicting tokens ``prompt_len ..`` of ``toks``: the prompt's last row, then one
    decode step per token."""
    n = len(toks)
    kv, blocks = fresh_cache(runner, n)
    m = runner.model
    meta = one_sequence_meta(0, prompt_len, blocks)
    h = m(torch.tensor(toks[:prompt_len]), torch.arange(prompt_len), kv, meta)
    out = [m.compute_logits(h)[-1:].float()]
    for i in range(prompt_len, n - 1):
        h = m(
            torch.tensor([toks[i]]),
            torch.tensor([i]),
            kv,
            one_sequence_meta(i, 1, blocks, decode=True),
        )
        out.append(m.compute_logits(h).float())
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="bf16 model directory")
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        if args.model != DEFAULT_MODEL:
            p.error(f"no model at {args.model}")
        from shared.cli.tiny_model import make_tiny_model

        make_tiny_model(args.model, preset="small", arch="llama")
    rng = random.Random(args.seed)
    n = args.prompt_len + args.new
    seqs = [[rng.randrange(100, 32000) for _ in range(n)] for _ in range(args.seqs)]
    fp32, bf16 = _runner(args.model, dtype="float32"), _runner(args.model)
    hits = {"prefill": 0, "decode": 0, "decode vs prefill": 0}
    err = {"prefill": 0.0, "decode": 0.0}
    total = 0
    for i, s in enumerate(seqs):
        ref = prefill_logits(fp32, s)[args.prompt_len - 1 : -1]
        got = {
            "prefill": prefill_logits(bf16, s)[args.prompt_len - 1 : -1],
            "decode": decode_logits(bf16, s, args.prompt_len),
        }
        scale = ref.std()
        for k, v in got.items():
            hits[k] += int((v.argmax(-1) == ref.argmax(-1)).sum())
            err[k] += float((v - ref).abs().mean() / scale)
        hits["decode vs prefill"] += int(
            (got["decode"].argmax(-1) == got["prefill"].argmax(-1)).sum()
        )
        total += ref.shape[0]
        print(f"\r{i + 1}/{len(seqs)} sequences", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"{total} positions, {args.seqs} sequences of {n} tokens")
    for k, v in hits.items():
        print(f"argmax agreement, {k + (' with fp32' if 'vs' not in k else '')}: {v / total:.4f}")
    for k, v in err.items():
        print(f"mean |logit error| / std(fp32 logits), {k}: {v / len(seqs):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

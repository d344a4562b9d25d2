"""Structured outputs (xgrammar constrained decoding): decode-step overhead and compile time.

Decode: on the ``small`` test model, for each batch size times ``--steps`` engine steps (no
HTTP) with every row unconstrained (``none``), every row constrained by a nested JSON schema
(``json``: objects, enums, bounded integers, arrays of objects, required keys) and, from batch 2,
every other row constrained (``mixed``). Each measurement builds a fresh engine and times the
steps with ``bench/decode_step.py``'s ``time_decode_steps`` (greedy, random prompts). Constrained
rows honour EOS and have no length cap, so a row leaves the batch only when its JSON is
complete; the schema needs at least ``MIN_ITEMS`` array entries (about 190 tokens at least
with the small model's greedy outputs). The rows actually decoding in the timed window (all,
and constrained) are counted from every row's output length, noted before each step in every
mode alike (a few microseconds), and reported. Rounds alternate the order of the modes so drift
hits all alike. Torch threads: ``--threads`` (1 by default, as ``bench/decode_step.py``).

Compile: per spec (small object, the nested schema, a 50-property schema, any JSON object, a
regex, a choice list, an EBNF grammar), through the workers' ``GrammarCompiler``
(``shared/engine/structured_output.py``): cold (a fresh compiler, after its one-time set-up,
timed on its own), warm (the same spec again: a cache hit), and a ``GrammarMatcher``'s
construction (what the sampler pays on the engine thread at a sequence's first constrained
draw).

Prints tables and writes JSON (+ a PNG beside it).

    python bench/structured_outputs.py [--model DIR] [--batches 1,16,64] [--steps 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.compare_vllm import DEFAULT_MODEL_DIR, RESULTS
from bench.decode_step import time_decode_steps
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams, StructuredOutputsParams

MIN_ITEMS = 3  # entries the decode schema's "items" array needs: keeps rows constrained long

STR = {"type": "string", "maxLength": 16}  # bounded: a random model would never close a string
DECODE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "status": {"enum": ["active", "inactive", "pending"]},
        "owner": {
            "type": "object",
            "properties": {"name": STR, "email": STR},
            "required": ["name", "email"],
        },
        "tags": {"type": "array", "items": STR},
        "items": {
            "type": "array",
            "minItems": MIN_ITEMS,
            "items": {
                "type": "object",
                "properties": {
                    "sku": STR,
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                    "in_stock": {"type": "boolean"},
                    "note": STR,
                },
                "required": ["sku", "qty", "in_stock", "note"],
            },
        },
    },
    "required": ["id", "status", "owner", "tags", "items"],
}


def big_schema(n: int = 50) -> dict[str, Any]:
    """``n`` properties cycling through string, integer, number, boolean, enum and array types,
    every other one required."""
    kinds: list[dict[str, Any]] = [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue", "other"]},
        {"type": "array", "items": {"type": "string"}},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": sorted(props)[::2]}


def compile_specs() -> dict[str, StructuredOutputsParams]:
    small = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    ebnf = "\n".join(
        [
            'root ::= expr "\\n"',
            'expr ::= term (("+" | "-") term)*',
            'term ::= factor (("*" | "/") factor)*',
            'factor ::= number | "(" expr ")" | "-" factor',
            'number ::= [0-9]+ ("." [0-9]+)?',
        ]
    )
    return {
        "json small object": StructuredOutputsParams(json=json.dumps(small)),
        "json nested (decode schema)": StructuredOutputsParams(json=json.dumps(DECODE_SCHEMA)),
        "json 50 properties": StructuredOutputsParams(json=json.dumps(big_schema())),
        "json_object (any)": StructuredOutputsParams(json_object=True),
        "regex (e-mail)": StructuredOutputsParams(
            regex=r"[a-z0-9._%+-]{1,32}@[a-z0-9-]{1,32}\.(com|org|net|io)"
        ),
        "choice (12 items)": StructuredOutputsParams(
            choice=tuple(f"option {c}" for c in "abcdefghijkl")
        ),
        "EBNF (arithmetic)": StructuredOutputsParams(grammar=ebnf),
    }


class ConstrainedEngine:
    """An engine for ``time_decode_steps``: the i-th request it is given is constrained by
    ``so`` where ``every`` divides i (``every`` 0: none), with EOS honoured and no length cap;
    before each step it notes every row's output length, so the timed window's actual batch
    can be read back (:meth:`window`). Anything else goes to the engine."""

    def __init__(self, engine: Any, so: StructuredOutputsParams, every: int) -> None:
        self._engine = engine
        self._so = so
        self._every = every
        self.reqs: list[Any] = []
        self.constrained: list[bool] = []
        self.snaps: list[list[int]] = []

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        con = self._every > 0 and len(self.reqs) % self._every == 0
        if con:
            params = dataclasses.replace(
                params, structured_outputs=self._so, ignore_eos=False, max_tokens=None
            )
        self._engine.add_request(request_id, prompt, params)
        self.reqs.append(self._engine.parents[request_id][0])
        self.constrained.append(con)

    def step(self) -> Any:
        self.snaps.append([len(r.output_token_ids) for r in self.reqs])  # the same in every mode
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def window(self, steps: int) -> dict[str, Any]:
        """Rows that decoded (one token, having one already) in each of the last ``steps``
        steps: all and constrained, min and mean; steps where some row was still prefilling."""
        snaps = [*self.snaps[-steps:], [len(r.output_token_ids) for r in self.reqs]]
        rows, cons, prefill_steps = [], [], 0
        for a, b in zip(snaps, snaps[1:]):
            dec = [i for i in range(len(a)) if a[i] >= 1 and b[i] == a[i] + 1]
            rows.append(len(dec))
            cons.append(sum(self.constrained[i] for i in dec))
            prefill_steps += any(x == 0 and not self.reqs[i].is_finished for i, x in enumerate(a))
        return {
            "rows_min": min(rows),
            "rows_mean": statistics.fmean(rows),
            "constrained_min": min(cons),
            "constrained_mean": statistics.fmean(cons),
            "prefill_steps": prefill_steps,
            "finished": sum(r.is_finished for r in self.reqs),
        }


def step_ms(
    model: str, batch: int, prompt_len: int, steps: int, so: StructuredOutputsParams, every: int
) -> tuple[float, dict[str, Any]]:
    llm = LLM(model, kv_cache_memory="512MiB")
    engine = ConstrainedEngine(llm.engine, so, every)
    ms = time_decode_steps(engine, batch, prompt_len, steps, max_token=30000)
    seen = engine.window(steps)
    del llm, engine
    gc.collect()
    return ms, seen


def time_compiles(model: str, rounds: int) -> tuple[list[dict[str, Any]], list[float]]:
    """Per spec: cold compile, warm compile (cache hit) and matcher construction, in ms (medians
    over ``rounds`` fresh compilers); and each fresh compiler's one-time set-up in ms."""
    import xgrammar as xgr

    from shared.config import EngineArgs
    from shared.engine.structured_output import GrammarCompiler

    mc = EngineArgs(model=model).create_model_config()
    specs = compile_specs()
    cold: dict[str, list[float]] = {k: [] for k in specs}
    warm: dict[str, list[float]] = {k: [] for k in specs}
    matcher: dict[str, list[float]] = {k: [] for k in specs}
    setup = []
    for r in range(rounds):
        gcomp = GrammarCompiler(model, mc.vocab_size, mc.eos_token_ids)
        t0 = time.perf_counter()
        gcomp._ensure_compiler()  # tokenizer info, xgrammar compiler, the vocabulary scans
        setup.append((time.perf_counter() - t0) * 1e3)
        gcomp.compile(StructuredOutputsParams(regex="a"))  # xgrammar's own first-use work
        for name, so in specs.items():
            t0 = time.perf_counter()
            compiled = gcomp.compile(so)
            t1 = time.perf_counter()
            gcomp.compile(so)
            t2 = time.perf_counter()
            xgr.GrammarMatcher(compiled.grammar)  # type: ignore[arg-type]
            t3 = time.perf_counter()
            cold[name].append((t1 - t0) * 1e3)
            warm[name].append((t2 - t1) * 1e3)
            matcher[name].append((t3 - t2) * 1e3)
        print(
            f"[compile] round {r + 1}/{rounds}: set-up {setup[-1]:.0f} ms, "
            + ", ".join(f"{k} {cold[k][-1]:.1f}" for k in specs)
            + " ms cold",
            flush=True,
        )
    rows = [
        {
            "spec": k,
            "kind": so.kind()[0],
            "chars": len(so.kind()[1]),
            "cold_ms": statistics.median(cold[k]),
            "warm_ms": statistics.median(warm[k]),
            "matcher_ms": statistics.median(matcher[k]),
            "cold_ms_all": cold[k],
        }
        for k, so in specs.items()
    ]
    return rows, setup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-rounds", type=int, default=3)
    ap.add_argument("--no-mixed", action="store_true", help="skip the half-constrained batches")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "structured_outputs.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["PDSERVE_NUM_THREADS"] = str(args.threads)
    from shared.cli.tiny_model import make_tiny_model

    model = Path(args.model)
    if not (model / "model.safetensors").exists():
        print(f"[structured] writing the small test model to {model}", flush=True)
        make_tiny_model(model, preset="small")
    batches = [int(b) for b in args.batches.split(",")]
    so = StructuredOutputsParams(json=json.dumps(DECODE_SCHEMA))
    modes = {"none": 0, "json": 1} | ({} if args.no_mixed else {"mixed": 2})
    print(f"[structured] {model}, torch threads {torch.get_num_threads()}", flush=True)

    compiles, setup = time_compiles(str(model), args.compile_rounds)

    plan = [
        (r, b, m)
        for r in range(args.rounds)
        for b in batches
        for m in (list(modes) if r % 2 == 0 else list(reversed(modes)))
        if not (m == "mixed" and b < 2)
    ]
    times: dict[tuple[str, int], list[float]] = {}
    seen: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for done, (r, b, m) in enumerate(plan, 1):
        ms, w = step_ms(str(model), b, args.prompt_len, args.steps, so, modes[m])
        times.setdefault((m, b), []).append(ms)
        seen.setdefault((m, b), []).append(w)
        print(
            f"[{done}/{len(plan)}] round {r + 1} batch {b} {m}: {ms:.2f} ms/step "
            f"(rows timed {w['rows_min']}/{b}, constrained {w['constrained_min']})",
            flush=True,
        )
        if w["rows_min"] < b or w["prefill_steps"]:
            print(
                f"  warning: the timed window had {w['rows_min']} decoding rows at least "
                f"(of {b}) and {w['prefill_steps']} steps with a prefill (rows that end: lower "
                "--steps; a prefill: lower --prompt-len)",
                flush=True,
            )

    decode = []
    for b in batches:
        base = statistics.median(times[("none", b)])
        row: dict[str, Any] = {"batch": b, "none_ms": base}
        for m in modes:
            if m == "none" or (m, b) not in times:
                continue
            t = statistics.median(times[(m, b)])
            ws = seen[(m, b)]
            row |= {
                f"{m}_ms": t,
                f"{m}_overhead_ms": t - base,
                f"{m}_ratio": t / base,
                f"{m}_rows_min": min(w["rows_min"] for w in ws),
                f"{m}_constrained_min": min(w["constrained_min"] for w in ws),
                f"{m}_constrained_mean": statistics.fmean(w["constrained_mean"] for w in ws),
            }
        row["all_ms"] = {m: times[(m, b)] for m in modes if (m, b) in times}
        row["windows"] = {m: seen[(m, b)] for m in modes if (m, b) in seen}
        decode.append(row)

    print("\n| batch | none ms/step | json ms/step | overhead ms | x none | rows timed (constrained) "
          "| mixed ms/step | mixed overhead ms | mixed x none | mixed rows timed (constrained) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for d in decode:
        cells = [f"{d['batch']}", f"{d['none_ms']:.2f}"]
        for m in ("json", "mixed"):
            if f"{m}_ms" in d:
                cells += [
                    f"{d[f'{m}_ms']:.2f}",
                    f"{d[f'{m}_overhead_ms']:+.2f}",
                    f"{d[f'{m}_ratio']:.2f}",
                    f"{d[f'{m}_rows_min']} ({d[f'{m}_constrained_min']})",
                ]
            else:
                cells += ["–"] * 4
        print("| " + " | ".join(cells) + " |")
    print(
        f"\ncompiler set-up (first use per worker: tokenizer info, vocabulary scans): "
        f"{statistics.median(setup):.0f} ms"
    )
    print("\n| spec | kind | chars | cold compile ms | warm (cache hit) ms | new matcher ms |")
    print("|---|---|---:|---:|---:|---:|")
    for c in compiles:
        print(
            f"| {c['spec']} | {c['kind']} | {c['chars']} | {c['cold_ms']:.2f} | "
            f"{c['warm_ms']:.3f} | {c['matcher_ms']:.3f} |"
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "torch_threads": torch.get_num_threads(),
                "decode_schema": DECODE_SCHEMA,
                "decode": decode,
                "compiler_setup_ms": setup,
                "compile": compiles,
            },
            indent=2,
        )
    )
    _plot(out.with_suffix(".png"), decode, compiles, modes)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


def _plot(
    path: Path, decode: list[dict[str, Any]], compiles: list[dict[str, Any]], modes: dict[str, int]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in modes:
        pts = [d for d in decode if f"{m}_ms" in d]
        a.plot([d["batch"] for d in pts], [d[f"{m}_ms"] for d in pts], "o-", label=m)
    a.set_xscale("log", base=2)
    a.set_xlabel("decode batch size")
    a.set_ylabel("ms / engine step")
    a.set_title("decode step: unconstrained vs JSON schema")
    a.legend()
    ys = range(len(compiles))
    b.barh([y + 0.2 for y in ys], [c["cold_ms"] for c in compiles], 0.4, label="cold")
    b.barh([y - 0.2 for y in ys], [c["warm_ms"] for c in compiles], 0.4, label="warm (cache)")
    b.set_yticks(list(ys))
    b.set_yticklabels([c["spec"] for c in compiles], fontsize=8)
    b.set_xscale("log")
    b.set_xlabel("ms")
    b.set_title("grammar compile")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

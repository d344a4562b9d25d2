"""Offline batch generation, like ``vllm.LLM``: an ``EngineCore`` stepped until every prompt is
done, outputs in prompt order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from shared.config import EngineArgs
from shared.engine.core import EngineCore, InvalidRequestError
from shared.engine.outputs import CompletionOutput, RequestOutput
from shared.engine.request import Logprob
from shared.engine.sampling_params import SamplingParams

# A string, a token-id list, or ``{"prompt_token_ids": ..., "prompt": ...}``.
PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    """Offline batch generation, like ``vllm.LLM``."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        from tokenizers import Tokenizer

        self.engine = EngineCore(EngineArgs(model=model, **engine_args))
        tok_path = engine_args.get("tokenizer") or model
        self.tokenizer = Tokenizer.from_file(f"{tok_path}/tokenizer.json")
        self._counter = 0

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, a token-id list, or ``{"prompt_token_ids": ...}``).

        Outputs come back in prompt order. A prompt the engine refuses raises
        ``InvalidRequestError`` before any prompt is queued.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(PromptType, prompts)]
        batch = cast(Sequence[PromptType], prompts)
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        token_lists: list[list[int]] = []
        texts: list[str | None] = []
        for p in batch:
            if isinstance(p, str):
                token_lists.append(self.tokenizer.encode(p).ids)
                texts.append(p)
            elif isinstance(p, dict):
                token_lists.append(list(p["prompt_token_ids"]))
                texts.append(p.get("prompt"))
            else:
                token_lists.append(list(p))
                texts.append(None)
        ids: list[str] = []
        added: list[str] = []
        try:
            for toks, sp in zip(token_lists, plist):
                rid = str(self._counter)
                self._counter += 1
                self.engine.add_request(rid, toks, sp)
                ids.append(rid)
                added.append(rid)
        except InvalidRequestError:
            self.engine.abort_request(added)
            raise
        return self._run(ids, texts, token_lists, plist, use_tqdm)

    def _run(
        self,
        ids: list[str],
        texts: list[str | None],
        token_lists: list[list[int]],
        plist: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        acc: dict[str, dict[int, dict[str, Any]]] = {rid: {} for rid in ids}
        cached: dict[str, int] = {}
        prompt_lps: dict[str, list[Logprob]] = {}
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts")
        while pending:
            for o in self.engine.step():
                if o.request_id not in acc:
                    continue
                seq = acc[o.request_id].setdefault(
                    o.index, {"ids": [], "lps": [], "finish": None, "stop": None, "error": None}
                )
                seq["ids"] += o.new_token_ids
                seq["lps"] += o.new_logprobs
                cached[o.request_id] = o.num_cached_tokens
                if o.prompt_logprobs is not None:
                    prompt_lps[o.request_id] = o.prompt_logprobs
                if o.finished:
                    seq["finish"], seq["stop"] = o.finish_reason, o.stop_token_id
                    if o.failure is not None:
                        seq["error"] = o.failure.message
                    n = plist[ids.index(o.request_id)].n
                    if len([s for s in acc[o.request_id].values() if s["finish"]]) == n:
                        pending.discard(o.request_id)
                        if bar:
                            bar.update(1)
            if not self.engine.has_unfinished_requests() and pending:
                raise RuntimeError(f"engine idle with {len(pending)} unfinished requests")
        if bar:
            bar.close()
        results = []
        for rid, text, toks, sp in zip(ids, texts, token_lists, plist):
            outs = []
            for idx in range(sp.n):
                s = acc[rid].get(idx) or {
                    "ids": [],
                    "lps": [],
                    "finish": "error",
                    "stop": None,
                    "error": "the request failed before this sample began",
                }
                lps: list[Logprob] | None = s["lps"] if sp.logprobs is not None else None
                outs.append(
                    CompletionOutput(
                        index=idx,
                        text=self.tokenizer.decode(s["ids"], skip_special_tokens=True),
                        token_ids=s["ids"],
                        cumulative_logprob=sum(lp.logprob for lp in lps) if lps else None,
                        logprobs=lps,
                        finish_reason=s["finish"],
                        stop_reason=s["stop"],
                        error=s["error"],
                    )
                )
            plp: list[Logprob | None] | None = None
            if sp.prompt_logprobs is not None and rid in prompt_lps:
                plp = [None, *prompt_lps[rid]]
            results.append(RequestOutput(rid, text, toks, outs, True, cached.get(rid, 0), plp))
        return results

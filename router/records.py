"""What the router keeps of a finished prompt: the decode worker's phase timings and the record
the dashboard lists (plain data; filled by ``router/generation.py``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """The decode worker's ``Timings`` of one prompt (seconds; see ``pdserve.proto``)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    blocks_transferred: int = 0
    first_token_s: float = 0.0
    decode_s: float = 0.0

    @classmethod
    def from_proto(cls, t: Any) -> PhaseTimings:
        return cls(
            t.queue_s,
            t.prefill_s,
            t.transfer_s,
            int(t.transfer_bytes),
            int(t.blocks_transferred),
            t.first_token_s,
            t.decode_s,
        )


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished prompt as the dashboard lists it."""

    request_id: str
    finished_at: float  # wall clock (time.time())
    path: str  # disagg | local | fallback
    decode_worker: str
    prefill_worker: str  # the router's choice; "" for local prefill
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    ttft_s: float | None  # router: arrival -> first token of the HTTP request
    e2e_s: float  # router: arrival -> end
    attempts: int  # 1 + retries
    timings: PhaseTimings | None  # None when the decode worker's final chunk never came

    def phases(self) -> list[tuple[str, float]]:
        """Consecutive segments that add up to ``e2e_s`` (when the worker reported timings).

        On the disaggregated path D stamps ``queue_s`` when the KV has arrived (that is when
        the request is first scheduled there), and ``transfer_s`` runs from the Prefill call
        to the last block, pushed while P computes. So: ``queue`` = admission on D (up to the
        Prefill call), ``prefill`` = P's compute, ``transfer`` = the rest of the KV wait that
        prefill compute did not hide (P's queue, RPC, the last blocks), ``handoff`` = KV in
        place -> first token ready. Locally (and after a fallback) ``prefill`` is queue end ->
        first token. ``router`` is the router's own share (tokenize, route, network, retries).
        """
        t = self.timings
        if t is None:
            ttft = self.ttft_s or 0.0
            return [("ttft", ttft), ("decode", max(0.0, self.e2e_s - ttft))]
        ft = max(t.first_token_s, 0.0)
        if self.path == "disagg":
            kv_ready = min(t.queue_s, ft)
            queue = max(0.0, kv_ready - t.transfer_s)
            prefill = min(t.prefill_s, kv_ready - queue)
            transfer = kv_ready - queue - prefill
        else:
            queue = min(t.queue_s, ft)
            prefill = min(t.prefill_s, ft - queue)
            transfer = 0.0
            kv_ready = queue + prefill
        handoff = ft - kv_ready
        router = max(0.0, self.e2e_s - ft - t.decode_s)
        return [
            ("router", router),
            ("queue", queue),
            ("prefill", prefill),
            ("transfer", transfer),
            ("handoff", handoff),
            ("decode", t.decode_s),
        ]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["phases"] = [{"name": n, "s": s} for n, s in self.phases()]
        return d

"""KV connectors: how a worker role takes part in a request's KV life, seen from the scheduler.

As vLLM's KVConnector, a connector is the one place where roles live; the scheduler calls its
hooks and knows nothing about prefill or decode workers:

* :meth:`KVConnector.num_external_tokens` (admission): how many of the request's tokens another
  worker computes. The scheduler reserves blocks for them (uncached) and parks the request in
  ``WAITING_FOR_REMOTE_KV`` until ``finish_remote_prefill``;
* :meth:`KVConnector.on_reserved`: those blocks were reserved;
* :meth:`KVConnector.blocks_ready` (after each step): blocks that became complete and are
  handed to a transfer from now on;
* :meth:`KVConnector.request_finished` (finish or abort): the request's state goes; blocks a
  transfer still uses stay pinned until the service unpins them (``KVCacheManager.pin``), so
  "hold" never delays freeing the request's table.

Three implementations: :class:`KVConnector` itself is the null connector (colocated workers,
the offline ``LLM``); :class:`DecodeConnector` receives a prompt's KV from a prefill worker;
:class:`PrefillConnector` exports blocks to a decode worker. A request opts in with
``kv_transfer`` params (:class:`RemotePrefillParams` / :class:`RemoteDecodeParams`), which a
connector that does not take them refuses. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.kv_cache_manager import KVCacheManager, cdiv
from shared.engine.request import Request


class KVTransferParamsError(ValueError):
    """``kv_transfer`` params this engine's connector does not take, or out of range."""

    def __init__(self, message: str, param: str = "kv_transfer") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RemotePrefillParams:
    """Decode role: the prompt's KV beyond the local prefix cache comes from a prefill worker."""


@dataclass(frozen=True, slots=True)
class RemoteDecodeParams:
    """Prefill role: a decode worker wants the prompt's blocks ``[first_block, end)``."""

    first_block: int


KVTransferParams = RemotePrefillParams | RemoteDecodeParams


@dataclass(frozen=True, slots=True)
class RemotePrefillJob:
    """Decode role: blocks reserved for a prefill worker to fill (the service starts the
    transfer). ``pin_id`` pins ``block_ids`` until the service unpins it, once the receive is
    terminal (or at once if it never posts one)."""

    request_id: str  # the parent request's id
    first_block_index: int  # index of block_ids[0] in the request's block table
    block_ids: tuple[int, ...]
    pin_id: int | None


@dataclass(slots=True)
class _Export:
    first_block_index: int
    num_blocks: int
    next_to_report: int = 0  # relative to first_block_index
    pin_id: int | None = None  # pins every block reported so far


class KVConnector:
    """The null connector: no KV comes from or goes to another worker."""

    role = "none"

    def __init__(self) -> None:
        self.kv: KVCacheManager | None = None

    def bind(self, kv: KVCacheManager) -> None:
        """Called once by the scheduler that owns ``kv``."""
        self.kv = kv

    # ---- admission ---------------------------------------------------------------------
    def check(
        self, params: KVTransferParams | None, num_prompt_tokens: int, block_size: int
    ) -> None:
        """Refuse ``params`` (raise :class:`KVTransferParamsError`) unless this connector takes
        them; called before anything is queued."""
        if params is not None:
            raise KVTransferParamsError(
                f"this engine ({self.role} role) takes no {type(params).__name__}"
            )

    def add(self, request: Request, params: KVTransferParams | None) -> None:
        """Remember ``params`` for ``request`` (the parent's first sequence), after ``check``."""

    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        """Tokens of ``request`` after its first ``num_computed`` whose KV another worker
        computes (0: compute them here)."""
        return 0

    def on_reserved(self, request: Request, block_ids: list[int], first_block: int) -> None:
        """Blocks ``block_ids`` (table indices from ``first_block`` on) were reserved for the
        external tokens; the request now waits for them."""

    # ---- steps -------------------------------------------------------------------------
    def blocks_ready(self, request: Request) -> list[tuple[int, int]]:
        """``(block index, block id)`` of blocks that became complete and go to a transfer
        (pinned from now on); called after every step that computed tokens of ``request``."""
        return []

    def pin_of(self, request: Request) -> int | None:
        """The pin holding the blocks ``blocks_ready`` reported for ``request``."""
        return None

    def holds_pin(self, request: Request) -> bool:
        """True while a transfer pins some of the request's blocks (preemption frees little)."""
        return False

    def request_finished(self, request: Request) -> None:
        """``request`` finished or was aborted: drop its state."""

    def take_jobs(self) -> list[RemotePrefillJob]:
        """Transfers to start since the last call (decode role)."""
        return []


class DecodeConnector(KVConnector):
    """Decode role: a request with :class:`RemotePrefillParams` gets its prompt's missing blocks
    reserved (and pinned) at admission and waits for a prefill worker to fill them."""

    role = "decode"

    def __init__(self) -> None:
        super().__init__()
        self._wanted: set[str] = set()  # sequence ids whose prompt KV comes from elsewhere
        self._jobs: dict[str, RemotePrefillJob] = {}  # reserved, not yet taken by the service

    def check(
        self, params: KVTransferParams | None, num_prompt_tokens: int, block_size: int
    ) -> None:
        if params is not None and not isinstance(params, RemotePrefillParams):
            raise KVTransferParamsError(
                f"a decode worker takes RemotePrefillParams, not {type(params).__name__}"
            )

    def add(self, request: Request, params: KVTransferParams | None) -> None:
        if params is not None and request.num_output_tokens == 0:
            self._wanted.add(request.request_id)

    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        if (
            request.request_id not in self._wanted
            or request.num_output_tokens
            or request.wants_prompt_logprobs  # their logits are computed here
        ):
            return 0
        return request.num_tokens - num_computed

    def on_reserved(self, request: Request, block_ids: list[int], first_block: int) -> None:
        assert self.kv is not None
        self._wanted.discard(request.request_id)  # asked once: a re-admission computes here
        needed = block_ids[first_block:]
        pin = self.kv.pin(needed) if needed else None
        self._jobs[request.request_id] = RemotePrefillJob(
            request.parent_id, first_block, tuple(needed), pin
        )

    def request_finished(self, request: Request) -> None:
        assert self.kv is not None
        self._wanted.discard(request.request_id)
        job = self._jobs.pop(request.request_id, None)
        if job is not None and job.pin_id is not None:
            self.kv.unpin(job.pin_id)  # never handed to the service: no transfer began

    def take_jobs(self) -> list[RemotePrefillJob]:
        jobs = list(self._jobs.values())
        self._jobs.clear()
        return jobs


class PrefillConnector(KVConnector):
    """Prefill role: a request with :class:`RemoteDecodeParams` reports (and pins) the blocks
    of its export range as they become complete."""

    role = "prefill"

    def __init__(self) -> None:
        super().__init__()
        self._exports: dict[str, _Export] = {}

    def check(
        self, params: KVTransferParams | None, num_prompt_tokens: int, block_size: int
    ) -> None:
        if params is None:
            return
        if not isinstance(params, RemoteDecodeParams):
            raise KVTransferParamsError(
                f"a prefill worker takes RemoteDecodeParams, not {type(params).__name__}"
            )
        n_blocks = cdiv(num_prompt_tokens, block_size)
        first = params.first_block
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < n_blocks:
            raise KVTransferParamsError(
                f"first_block_index {first!r} is outside the prompt's {n_blocks} blocks",
                "first_block_index",
            )

    def add(self, request: Request, params: KVTransferParams | None) -> None:
        if params is not None:
            assert isinstance(params, RemoteDecodeParams)
            n_blocks = cdiv(request.num_prompt_tokens, request.block_size) - params.first_block
            self._exports[request.request_id] = _Export(params.first_block, max(0, n_blocks))

    def blocks_ready(self, request: Request) -> list[tuple[int, int]]:
        exp = self._exports.get(request.request_id)
        if exp is None:
            return []
        assert self.kv is not None
        bs = request.block_size
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        complete = computed // bs
        if computed == request.num_prompt_tokens:
            complete = cdiv(computed, bs)  # the last, partial block is final too
        end = min(complete - exp.first_block_index, exp.num_blocks)
        if end <= exp.next_to_report:
            return []
        ids = self.kv.block_ids(request.request_id)
        ready = [
            (exp.first_block_index + j, ids[exp.first_block_index + j])
            for j in range(exp.next_to_report, end)
        ]
        exp.next_to_report = end
        # handed to the sender from here on: pinned until the transfer is terminal, so a
        # preemption, an abort or the finish cannot free them under the send
        exp.pin_id = self.kv.pin([b for _, b in ready], exp.pin_id)
        return ready

    def pin_of(self, request: Request) -> int | None:
        exp = self._exports.get(request.request_id)
        return exp.pin_id if exp is not None else None

    def holds_pin(self, request: Request) -> bool:
        exp = self._exports.get(request.request_id)
        return exp is not None and exp.pin_id is not None

    def request_finished(self, request: Request) -> None:
        self._exports.pop(request.request_id, None)  # the pin is the service's to drop


def connector_for_role(role: str) -> KVConnector:
    """The connector of a worker role ("prefill", "decode"; anything else: the null one)."""
    if role == "decode":
        return DecodeConnector()
    if role == "prefill":
        return PrefillConnector()
    return KVConnector()


__all__ = [
    "KVConnector",
    "DecodeConnector",
    "PrefillConnector",
    "KVTransferParams",
    "KVTransferParamsError",
    "RemotePrefillParams",
    "RemoteDecodeParams",
    "RemotePrefillJob",
    "connector_for_role",
]

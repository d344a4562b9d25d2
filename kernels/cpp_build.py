"""Building the C++ CPU extensions (``kernels/csrc``) with ``torch.utils.cpp_extension``.

Each is cached under ``~/.cache/torch_extensions`` by a name that hashes its source (its text
and its path), its flags, torch's version and the CPU's feature flags, so a changed kernel, or a
cache dir shared with another CPU model (AMX or not) or another checkout, builds afresh instead
of loading a stale or illegal binary (or rebuilding the other checkout's, in turn).

torch serializes the processes that build or load one extension with a plain ``lock`` file in
its build directory, which a process killed while it holds it (Ctrl-C of a first ``pdserve
up``, kill -9 of a starting worker) leaves behind: every later load then waits on it forever,
silently. So pdserve's processes first take a ``flock`` on their own file in that directory
(the kernel drops it when its holder dies); whoever holds it is the only pdserve process in
``load``, so a ``lock`` file found then is stale and is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import IO

import torch

logger = logging.getLogger(__name__)


def cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for exactly these)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def extension_name(prefix: str, source: Path, flags: list[str]) -> str:
    """``<prefix>_<hash>`` (see the module docstring)."""
    h = hashlib.sha256(source.read_bytes())
    # the source's path too: ninja's build file names it, so two checkouts of the same kernel
    # sharing one build directory rewrote it in turn and each load rebuilt the extension (a
    # process of the other checkout waited on the build lock for minutes meanwhile)
    for part in (str(source.resolve()), " ".join(flags), torch.__version__, cpu_flags()):
        h.update(b"\0" + part.encode())
    return f"{prefix}_{h.hexdigest()[:16]}"


def build(prefix: str, source: Path, flags: list[str]):  # type: ignore[no-untyped-def]
    """Build (or load the cached build of) ``source``; raises what the compiler raises."""
    from torch.utils.cpp_extension import _get_build_directory, load

    _ninja_on_path()
    name = extension_name(prefix, source, flags)
    directory = Path(_get_build_directory(name, verbose=False))  # torch's own: caches shared
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "pdserve.flock", "a") as guard:
        _flock(guard, name)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build or load that was killed", stale)
            stale.unlink(missing_ok=True)
        return load(
            name=name,
            sources=[str(source)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=bool(os.environ.get("PDSERVE_VERBOSE_BUILD")),
        )  # the flock goes with the file's close (or this process's death)


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from ``PATH``; the one pdserve's ``[engine]`` extra installs sits
    beside this interpreter (``.venv/bin``), which is not on ``PATH`` unless the venv was
    activated (``make up`` runs ``.venv/bin/pdserve``): without a system ninja every build
    then failed and the workers ran torch's kernels. Puts that directory on ``PATH`` (this
    process's and its children's) where no ninja is found otherwise."""
    here = Path(sys.executable).parent
    if shutil.which("ninja") is None and (here / "ninja").exists():
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"


def _flock(f: IO[str], name: str) -> None:
    """Take ``f``'s exclusive flock, saying every 30 s that another process holds it (a build
    on 2 cores takes a minute or two; a holder that dies releases it)."""
    t0 = time.monotonic()
    said = 0.0
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited = time.monotonic() - t0
            if waited - said >= 30.0:
                said = waited
                logger.warning(
                    "waiting %.0f s for another process building or loading %s", waited, name
                )
            time.sleep(0.1)

"""Child processes that die with their parent, started without Python between fork and exec.

``subprocess.Popen(preexec_fn=...)`` runs Python in the forked child before ``exec``. In a
process with other threads (gRPC's, uvicorn's, a test's) that child runs on state copied
mid-change from threads that do not exist in it, and gRPC's own fork handlers run in it:
with grpc.aio busy, about half such children died of SIGSEGV before ``exec`` (measured), and
a child can as well deadlock on a lock copied held. Without ``preexec_fn`` CPython forks with ``vfork`` and runs only async-signal-safe C
until ``exec``.

The parent-death signal is set instead by a few lines of Python that the child runs *after*
``exec``, in a fresh interpreter that has no threads, before it ``exec``s the real command
under the same pid. If the parent died before that, the child exits at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

# argv[1] = signal number, argv[2] = the parent's pid, argv[3:] = the command.
_SHIM = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]))  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os._exit(70)  # the parent is already gone\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def dying_with_parent_argv(cmd: Sequence[str], deathsig: int = signal.SIGKILL) -> list[str]:
    """``cmd`` wrapped so that, on Linux, the child gets ``deathsig`` when the thread that
    started it exits (``PR_SET_PDEATHSIG``). Elsewhere the command runs unwrapped."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _SHIM,
        str(int(deathsig)),
        str(os.getpid()),
        *cmd,
    ]


def popen_dying_with_parent(
    cmd: Sequence[str],
    *,
    deathsig: int = signal.SIGKILL,
    new_session: bool = True,
    **kwargs: Any,
) -> subprocess.Popen[Any]:
    """``Popen`` of ``cmd`` in its own session (``new_session``) or its own process group,
    killed with ``deathsig`` when its parent dies; the pid is the command's own."""
    if "preexec_fn" in kwargs:
        raise TypeError("popen_dying_with_parent never runs a preexec_fn")
    if new_session:
        kwargs["start_new_session"] = True
    else:
        kwargs["process_group"] = 0
    return subprocess.Popen(dying_with_parent_argv(cmd, deathsig), **kwargs)

"""Build the C++ CPU extensions now, both at once, instead of in the first process that needs
them: ``python -m kernels.prebuild``.

``scripts/setup.sh`` runs it in the background while pip installs the rest of pdserve, so the
minute or two of compiling on a 2-core machine overlaps the install instead of holding up the
first worker (or the first test) that loads a kernel. A process that loads an extension while
this one builds it waits on the build's ``flock`` (``kernels/cpp_build.py``) and then loads the
cached result. A failed build is reported and left to the runtime, which falls back to torch's
kernels just as it would without this step; the exit status is 0 either way (``--strict``: 1).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strict", action="store_true", help="exit 1 when an extension fails")
    a = ap.parse_args(argv)
    from kernels import cpu_paged, quant_cpu

    results: dict[str, str] = {}

    def run(name: str, build, why) -> None:  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            build()  # each swallows its own compiler errors (why() says them) ...
        except Exception as e:  # noqa: BLE001 - ... and anything else is reported here
            results[name] = f"failed: {type(e).__name__}: {e}"
            return
        err = why()
        results[name] = f"failed: {err}" if err else f"ready in {time.monotonic() - t0:.0f} s"

    builds = {
        "pdserve_cpu_paged": (cpu_paged._build, lambda: cpu_paged._failed),
        # built on every CPU; the binary then says whether the CPU runs it (AVX512-BF16)
        "pdserve_quant_cpu": (
            quant_cpu.extension,
            lambda: None if quant_cpu._failed == quant_cpu.NOT_THIS_CPU else quant_cpu._failed,
        ),
    }
    threads = [
        threading.Thread(target=run, args=(name, *fns), daemon=True) for name, fns in builds.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = False
    for name in builds:
        what = results.get(name, "failed: its build thread ended without a word")
        print(f"[prebuild] {name}: {what}", flush=True)
        failed = failed or what.startswith("failed")
    return 1 if (failed and a.strict) else 0


if __name__ == "__main__":
    sys.exit(main())

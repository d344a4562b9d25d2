"""The C++ extensions' build lock (``kernels/cpp_build.py``).

torch's ``load`` serializes processes with a plain ``lock`` file in the build directory. A
process killed while it holds it (Ctrl-C of a first ``pdserve up`` while a worker built or
loaded the kernels) left it behind, and every later worker waited on it forever without a word:
``pdserve up`` then never started. Found trying ``make up`` on a fresh clone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

from kernels import cpu_paged

ROOT = Path(__file__).resolve().parents[2]
LOAD = (
    "from kernels import cpp_build, cpu_paged; "
    "cpp_build.build('pdserve_cpu_paged', cpu_paged.SOURCE, cpu_paged._FLAGS); print('loaded')"
)


@pytest.mark.integration  # a subprocess that loads (or builds) the C++ extension
def test_a_lock_left_by_a_killed_process_does_not_hang_the_next_one():
    directory = Path(_get_build_directory(cpu_paged.extension_name(), verbose=False))
    directory.mkdir(parents=True, exist_ok=True)
    stale = directory / "lock"
    stale.touch()  # what torch's FileBaton leaves when its holder is killed
    try:
        # (a build from scratch takes a minute or two on 2 cores; a cached load a second)
        out = subprocess.run(
            [sys.executable, "-c", LOAD],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        leftover = stale.exists()
        stale.unlink(missing_ok=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("loaded")
    assert not leftover
    assert "left by a build or load that was killed" in out.stderr


@pytest.mark.unit
def test_two_checkouts_of_one_kernel_build_in_directories_of_their_own(tmp_path):
    """ninja's build file names the source's path: two checkouts of the same kernel text shared
    one build directory and rewrote it in turn, so every load of one rebuilt the other's
    extension (a CI run beside a working tree saw its tensor-parallel ranks wait minutes for the
    build lock and time out)."""
    from kernels.cpp_build import extension_name

    a, b = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("int f() { return 1; }\n")
    assert extension_name("x", a, ["-O2"]) != extension_name("x", b, ["-O2"])
    assert extension_name("x", a, ["-O2"]) == extension_name("x", a, ["-O2"])


@pytest.mark.integration  # builds (or loads the cached build of) both extensions
def test_prebuild_builds_both_extensions_and_reports_them(capsys):
    """``python -m kernels.prebuild`` (run by scripts/setup.sh while pip installs the rest)."""
    from kernels import prebuild

    assert prebuild.main([]) == 0
    out = capsys.readouterr().out
    assert "[prebuild] pdserve_cpu_paged: ready" in out, out
    assert "[prebuild] pdserve_quant_cpu: ready" in out, out
    assert cpu_paged.available()


@pytest.mark.unit
def test_prebuild_reports_a_failed_build_and_fails_only_when_strict(monkeypatch, capsys):
    from kernels import prebuild, quant_cpu

    def broken():
        raise RuntimeError("no compiler")

    # a fresh module state: the real extension may already be loaded in this process
    monkeypatch.setattr(cpu_paged, "_ext", None)
    monkeypatch.setattr(cpu_paged, "_failed", None)
    monkeypatch.setattr(cpu_paged, "_build", broken)
    monkeypatch.setattr(quant_cpu, "_ext", None)
    monkeypatch.setattr(quant_cpu, "_failed", quant_cpu.NOT_THIS_CPU)
    assert prebuild.main([]) == 0  # reported, left to the runtime's fallback
    out = capsys.readouterr().out
    assert "[prebuild] pdserve_cpu_paged: failed: RuntimeError: no compiler" in out, out
    assert "[prebuild] pdserve_quant_cpu: ready" in out, out  # built; the CPU just lacks bf16
    assert prebuild.main(["--strict"]) == 1


@pytest.mark.unit
def test_prebuild_reports_a_build_the_loader_swallowed(monkeypatch, capsys):
    """cpu_paged._build catches the compiler's error itself (the runtime falls back) and
    returns None: prebuild still says it failed, with the loader's reason."""
    from kernels import prebuild, quant_cpu

    def swallowed():
        monkeypatch.setattr(cpu_paged, "_failed", "CalledProcessError: g++ exited 1")
        return None

    monkeypatch.setattr(cpu_paged, "_failed", None)
    monkeypatch.setattr(cpu_paged, "_build", swallowed)
    monkeypatch.setattr(quant_cpu, "_ext", None)
    monkeypatch.setattr(quant_cpu, "_failed", "OSError: no headers")
    assert prebuild.main(["--strict"]) == 1
    out = capsys.readouterr().out
    assert "pdserve_cpu_paged: failed: CalledProcessError: g++ exited 1" in out, out
    assert "pdserve_quant_cpu: failed: OSError: no headers" in out, out


@pytest.mark.unit
def test_the_venvs_ninja_is_found_without_an_activated_venv(monkeypatch, tmp_path):
    """torch runs ``ninja`` from PATH; pip puts the ``[engine]`` extra's ninja in .venv/bin,
    which `make up` (``.venv/bin/pdserve up``) never puts on PATH: on a machine without a system
    ninja every build failed and the workers ran torch's kernels instead."""
    from kernels import cpp_build

    bindir = tmp_path / "venv-bin"
    bindir.mkdir()
    (bindir / "ninja").write_text("#!/bin/sh\n")
    (bindir / "ninja").chmod(0o755)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", str(empty))
    cpp_build._ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == str(bindir)
    # a ninja found on PATH already is left alone
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{empty}")
    other = tmp_path / "other-bin"
    other.mkdir()
    monkeypatch.setattr(sys, "executable", str(other / "python"))
    cpp_build._ninja_on_path()
    assert os.environ["PATH"] == f"{bindir}{os.pathsep}{empty}"

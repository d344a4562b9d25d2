"""The import graph keeps its shape (docs/architecture.md, "Packages"): every import of every
project module, deferred ones included, is checked against the layering rules below."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "shared",
    "router",
    "kvtransfer",
    "kernels",
    "prefill_service",
    "decode_service",
    "bench",
)
ENGINE_CORE = (
    "shared.engine.core",
    "shared.engine.llm",
    "shared.engine.scheduler",
    "shared.engine.scheduler_output",
    "shared.engine.kv_cache_manager",
    "shared.engine.block_pool",
    "shared.engine.request",
    "shared.engine.sampling_params",
    "shared.engine.outputs",
    "shared.engine.connector",
    "shared.engine.__init__",
)
CONTRACTS = (
    "shared.config",
    "shared.hashing",
    "shared.kv_events",
    "shared.prom",
    "shared.directory",
    "shared.proto",
)
TENSOR_LIBS = ("torch", "triton", "numpy", "safetensors", "transformers")

# (who, what it must not import, why)
RULES: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (
        ("router",),
        (
            "shared.engine",
            "shared.worker",
            "shared.cli",
            "kvtransfer",
            "kernels",
            "prefill_service",
            "decode_service",
            "bench",
            "torch",
            "triton",
            "ucxx",
        ),
        "the router installs without torch and never imports the engine or the data plane",
    ),
    (
        ("kvtransfer",),
        ("shared", "router", "kernels", "prefill_service", "decode_service", "bench"),
        "the data plane knows nothing of the engine or the services",
    ),
    (
        ("kernels",),
        ("shared", "router", "kvtransfer", "prefill_service", "decode_service", "bench"),
        "kernels import nothing from the project",
    ),
    (
        CONTRACTS,
        (
            "shared.engine",
            "shared.worker",
            "shared.cli",
            "router",
            "kvtransfer",
            "kernels",
            "prefill_service",
            "decode_service",
            "bench",
            *TENSOR_LIBS,
        ),
        "the contracts shared with the router stay free of the engine and of torch",
    ),
    (
        ("shared.engine",),
        (
            "shared.worker",
            "shared.cli",
            "router",
            "kvtransfer",
            "prefill_service",
            "decode_service",
            "bench",
        ),
        "the engine is driven by the services, never the other way round",
    ),
    (
        ENGINE_CORE,
        (
            *TENSOR_LIBS,
            "kernels",
            "shared.models",
            "shared.engine.model_runner",
            "shared.engine.sampler",
            "shared.engine.device",
        ),
        "the engine core is plain Python: only the model runner, the sampler and the models "
        "touch tensors or kernels (the core builds the runner through a deferred import)",
    ),
    (
        ("shared.engine.sampler",),
        ("kernels",),
        "the sampler gets the backend's argmax from the model runner, not from kernels",
    ),
    (
        ("shared.worker",),
        ("router", "prefill_service", "decode_service", "shared.cli", "bench"),
        "worker plumbing serves both roles and knows neither",
    ),
    (("prefill_service",), ("decode_service", "router"), "the roles never import each other"),
    (("decode_service",), ("prefill_service", "router"), "the roles never import each other"),
]
# deferred imports that are the documented exceptions to a rule above
ALLOWED = {
    ("shared.engine.core", "shared.engine.model_runner"),  # EngineCore builds the real runner
    ("shared.engine.core", "shared.engine.device"),  # and asks which device "auto" is
}


def module_name(path: Path) -> str:
    """Dotted name; a package's ``__init__`` keeps its ``.__init__`` so that rules can name a
    package's own module apart from its submodules."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def allowed(mod: str, name: str) -> bool:
    return any(m == mod and within(name, (a,)) for m, a in ALLOWED)


def project_modules() -> dict[str, set[str]]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mods[module_name(path)] = imports_of(path)
    return mods


def test_the_import_graph_follows_the_layering_rules():
    mods = project_modules()
    assert len(mods) > 80, "the walk found the project"
    broken = [
        f"{mod} imports {name}: {why}"
        for mod, imported in sorted(mods.items())
        for who, banned, why in RULES
        if within(mod, who)
        for name in sorted(imported)
        if within(name, banned) and not allowed(mod, name)
    ]
    assert broken == [], "\n".join(broken)


@pytest.mark.parametrize("mod, name", sorted(ALLOWED))
def test_every_allowed_exception_is_still_needed(mod, name):
    assert any(within(i, (name,)) for i in project_modules()[mod]), (
        f"{mod} no longer imports {name}: drop the exception"
    )

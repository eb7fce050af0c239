"""The floors' import rules (READMEs, DESIGN.md §2), checked over the source tree so the diagram
cannot drift: every `import` / `from ... import` statement of every module counts, the lazy ones
inside functions too (a lazy upward import is still an upward import). A planted violation in a
throw-away tree shows each rule can fail."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("l2core", "l3pool")

# (importer prefix, imported prefix, why): a module whose dotted name starts with the first never
# imports a module whose dotted name starts with the second. Prefixes match whole components.
NEVER: list[tuple[str, str, str]] = [
    ("l2core", "l3pool", "l2core is the floor under l3pool"),
    ("l2core", "bench", "the library never imports the benchmarks"),
    ("l3pool", "bench", "the library never imports the benchmarks"),
    ("l2core", "deploy", "the library never imports deploy/"),
    ("l3pool", "deploy", "the library never imports deploy/"),
    *(
        ("l3pool.pool", up, "the pool core never imports the floors above it")
        for up in ("l3pool.cache", "l3pool.cluster", "l3pool.tools", "l3pool.adapters", "l3pool.agent", "l3pool.cli")
    ),
    *(
        ("l3pool.cache", up, "the cache controller never imports what stands beside or above it")
        for up in ("l3pool.cluster", "l3pool.tools", "l3pool.adapters", "l3pool.agent", "l3pool.cli")
    ),
    *(
        ("l3pool.cache", up, "the cache never imports the global index (its events' wire format is in the pool core)")
        for up in ("l3pool.index",)
    ),
    *(
        ("l3pool.index", up, "the global index stands beside the cache: it imports only the pool core and l2core")
        for up in ("l3pool.cache", "l3pool.cluster", "l3pool.tools", "l3pool.adapters", "l3pool.agent", "l3pool.demo")
    ),
    ("l3pool.pool", "l3pool.index", "the pool core never imports the floors above it"),
    *(
        ("l3pool.router", up, "the router imports l3pool.index's types and nothing else of l3pool")
        for up in ("l3pool.cache", "l3pool.pool", "l3pool.cluster", "l3pool.tools", "l3pool.adapters")
    ),
    *(
        ("l3pool.router", up, "the router imports l3pool.index's types and nothing else of l3pool")
        for up in ("l3pool.agent", "l3pool.cli", "l3pool.demo", "l2core", "torch")
    ),
    ("l3pool.index", "l3pool.router", "the index never imports the router that queries it"),
    ("l3pool.index", "torch", "the index host runs without torch (pip install 'l3pool[index]'), lazily too"),
    ("l3pool.index", "l2core", "of l2core the index imports only the torch-free build cache (l2core._build)"),
    ("l3pool.tools", "l3pool.adapters", "operator tools never import engine integrations"),
    ("l3pool.cluster", "l3pool.adapters", "the local cluster never imports engine integrations"),
    ("l3pool.agent", "l3pool.adapters", "the decode-node agent never imports engine integrations"),
    ("l3pool.agent", "l3pool.cache", "the decode-node agent never imports the cache controller (no torch)"),
    ("l3pool.agent", "l3pool.tools", "the decode-node agent never imports the operator tools"),
]
# the exceptions to NEVER, each with its reason: (importer prefix, imported module) -> why
EXCEPT: dict[tuple[str, str], str] = {
    ("l3pool.index", "l2core._build"): "the build cache its native table is built through: torch-free",
    ("l3pool.tools", "l3pool.adapters.sglang_config"): (
        "the SGLang extra-config schema that `deploy render` writes and `check-config` checks: plain "
        "config parsing, neither torch nor sglang (it is a TORCH_FREE_ROOT)"
    ),
}
# nothing outside the demo imports it (the CLI loads its subcommand by dotted name, not by import)
PRIVATE = {"l3pool.demo": "the demo is an application: nothing imports it"}
# modules a decode node imports without torch (and the TP-shared segment janitor, which starts as
# its own process): neither they nor anything they import names torch
TORCH_FREE_ROOTS = (
    "l3pool.agent",
    "l3pool.cli",
    "l3pool.tools.inspect",
    "l3pool.pool.metadata",
    "l2core.shm_segment",
    "l3pool.pool.admin",
    "l3pool.values",
    "l3pool.pool.kv_events",
    "l3pool.pool.keys",
    "l3pool.cache.events",
    "l3pool.index",
    "l3pool.index.client",
    "l3pool.index.cli",
    "l3pool.index.service",
    "l3pool.index.table",
    "l3pool.index.native",
    "l3pool.index.metrics",
    "l3pool.index.guard",
    "l2core._build",
    "l3pool.router",
    "l3pool.adapters.sglang_config",
    "l3pool.tools.check_config",
)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import statement of `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target, node.lineno, id(node) in top
            for a in node.names:  # `from l3pool import cache` imports l3pool.cache
                yield f"{target}.{a.name}", node.lineno, id(node) in top


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def import_graph(root: Path) -> dict[str, list[tuple[str, int, bool, Path]]]:
    graph: dict[str, list[tuple[str, int, bool, Path]]] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            mod = _module_name(path, root)
            graph[mod] = [(t, line, top, path) for t, line, top in _imports(path, mod)]
    return graph


def violations(root: Path) -> list[str]:
    graph = import_graph(root)
    out = []
    for mod, edges in graph.items():
        for target, line, _, path in edges:
            where = f"{path.relative_to(root)}:{line}: {mod} imports {target}"
            for src, dst, why in NEVER:
                allowed = any(_under(mod, a) and _under(target, b) for a, b in EXCEPT)
                if _under(mod, src) and _under(target, dst) and not allowed:
                    out.append(f"{where} ({why})")
            for private, why in PRIVATE.items():
                if _under(target, private) and not _under(mod, private):
                    out.append(f"{where} ({why})")
    # torch-free closure: follow module-level imports of project modules from the roots
    seen: set[str] = set()
    stack = [(r, r) for r in TORCH_FREE_ROOTS if r in graph]
    while stack:
        mod, via = stack.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for target, line, top, path in graph.get(mod, []):
            if not top:
                continue  # a lazy import is the point of staying torch-free
            if _under(target, "torch"):
                out.append(f"{path.relative_to(root)}:{line}: {mod} imports torch at module level (reached from {via})")
            elif target in graph:
                stack.append((target, via))
    return sorted(set(out))


def test_the_source_tree_keeps_the_import_rules() -> None:
    found = violations(ROOT)
    assert not found, "import rules broken:\n" + "\n".join(found)
    assert len(import_graph(ROOT)) > 50  # the walk read the tree


def _plant(tmp: Path, files: dict[str, str]) -> Path:
    for pkg in PACKAGES:
        (tmp / pkg).mkdir(parents=True, exist_ok=True)
        (tmp / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        for d in p.relative_to(tmp).parents:
            if str(d) != "." and not (tmp / d / "__init__.py").exists():
                (tmp / d / "__init__.py").write_text("")
        p.write_text(text)
    return tmp


@pytest.mark.parametrize(
    ("files", "expect"),
    [
        ({"l2core/ops.py": "import l3pool.pool.store\n"}, "l2core is the floor under l3pool"),
        ({"l3pool/pool/client.py": "def f():\n    from l3pool.cache import controller\n"}, "pool core never"),
        ({"l3pool/pool/client.py": "from ..cache import controller\n"}, "pool core never"),
        ({"l3pool/pool/client.py": "from l3pool import tools\n"}, "pool core never"),
        ({"l3pool/tools/inspect.py": "from l3pool.adapters import sglang_hicache\n"}, "operator tools never"),
        ({"l3pool/cache/controller.py": "import bench.cache\n"}, "never imports the benchmarks"),
        ({"l3pool/tools/chaos.py": "from l3pool.demo.run import Demo\n"}, "the demo is an application"),
        ({"l3pool/cache/events.py": "from l3pool.index import table\n"}, "never imports the global index"),
        ({"l3pool/index/service.py": "from l3pool.cache.events import x\n"}, "stands beside the cache"),
        ({"l3pool/index/table.py": "def f():\n    import torch\n"}, "the index host runs without torch"),
        ({"l3pool/index/native.py": "from l2core import _native\n"}, "only the torch-free build cache"),
        ({"l3pool/index/native.py": "def f():\n    from l2core.ops import x\n"}, "only the torch-free build cache"),
        ({"l3pool/router/policy.py": "from l3pool.cache import types\n"}, "the router imports l3pool.index"),
        ({"l3pool/router/policy.py": "def f():\n    import l2core.ops\n"}, "the router imports l3pool.index"),
        (
            {"l3pool/agent.py": "from l3pool.pool import keys\n", "l3pool/pool/keys.py": "import torch\n"},
            "imports torch",
        ),
    ],
)
def test_a_planted_violation_is_found(tmp_path: Path, files: dict[str, str], expect: str) -> None:
    found = violations(_plant(tmp_path, files))
    assert any(expect in v for v in found), found


def test_allowed_imports_are_not_flagged(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "l3pool/cache/controller.py": "from l3pool.pool import client\nimport l2core.ops\n",
            "l3pool/demo/run.py": "from . import study\nfrom l3pool.cache import controller\n",
            "l3pool/demo/study.py": "",
            "l3pool/agent.py": "def f():\n    import torch\n",  # lazy: allowed for a torch-free module
        },
    )
    assert violations(root) == []

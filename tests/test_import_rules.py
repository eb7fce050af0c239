"""The floors' import rules (READMEs, docs/design.md §2), checked over the source tree so the diagram
cannot drift: every `import` / `from ... import` statement of every module counts, the lazy ones
inside functions too (a lazy upward import is still an upward import), and so do the imports by
name: `importlib.import_module("...")` / `__import__("...")` with a literal, and the tables of
dotted names a module loads (`BY_NAME`). The library and bench/ are read. A planted violation in
a throw-away tree shows each rule can fail."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("l2core", "l3pool")  # the library
SCANNED = (*PACKAGES, "bench")  # whose modules' imports are read (bench/results/ is history, not code)
# what stands above the pool core (l3pool.pool) and l3pool.cliutil, the commands' helpers
ABOVE_POOL = (
    "l3pool.cache", "l3pool.cluster", "l3pool.tools", "l3pool.adapters", "l3pool.agent", "l3pool.cli",
    "l3pool.demo", "l3pool.index", "l3pool.router",
)  # fmt: skip

# (importer prefix, imported prefix, why): a module whose dotted name starts with the first never
# imports a module whose dotted name starts with the second. Prefixes match whole components.
NEVER: list[tuple[str, str, str]] = [
    ("l2core", "l3pool", "l2core is the floor under l3pool"),
    ("l2core", "bench", "the library never imports the benchmarks"),
    ("l3pool", "bench", "the library never imports the benchmarks"),
    ("l2core", "deploy", "the library never imports deploy/"),
    ("l3pool", "deploy", "the library never imports deploy/"),
    *(("l3pool.pool", up, "the pool core never imports the floors above it") for up in ("l3pool.cliutil", *ABOVE_POOL)),
    *(
        ("l3pool.cliutil", up, "the commands' helpers sit below every command: nothing above the pool core")
        for up in ABOVE_POOL
    ),
    *(
        (below, "l3pool.cli", "only the entry point imports l3pool.cli; the commands' helpers are l3pool.cliutil")
        for below in (*PACKAGES, "bench")
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
    ("l3pool.__main__", "l3pool.cli"): "the entry point: `python -m l3pool` runs the command line",
    ("l3pool.cli", "l3pool.demo"): "the entry point loads the `l3pool demo` command by name (BY_NAME)",
    ("l3pool.index", "l2core._build"): "the build cache its native table is built through: torch-free",
    ("l3pool.tools", "l3pool.adapters.sglang_config"): (
        "the SGLang extra-config schema that `deploy render` writes and `check-config` checks: plain "
        "config parsing, neither torch nor sglang (it is a TORCH_FREE_ROOT)"
    ),
}
# nothing else of the library imports it (the entry point loads its command by name: BY_NAME, EXCEPT)
PRIVATE = {"l3pool.demo": "the demo is an application: nothing imports it"}
# the benchmarks use the library as its users do (each rule is checked for every module of bench/)
BENCH_RULES = {
    "library_private": "bench never imports a private module or name of the library (a `_` component, e.g. "
    "l2core._native): those are the library's to change; what bench needs is a public name (l2core.load_native)",
    "demo_modules": "bench takes from the demo only what the l3pool.demo package exports (`from l3pool.demo "
    "import HFModel`), never a module of it: the demo's modules are the application's own",
    "bench_helper": "a bench helper (a `_` module or name) belongs to the package it sits in: only modules beside "
    "it (or below) import it; one that several benchmarks share sits in bench/ itself",
}
# modules that load others by a table of module names: module -> (the module-level table: a tuple of
# names, or a dict whose values are names; names relative to the package when they have no dot;
# whether they count as imported at module level, why). A package's lazy exports load on first use.
BY_NAME: dict[str, tuple[str, bool, str]] = {
    "l3pool.cli": ("_COMMANDS", True, "the entry point loads every command on every run (main), `l3pool info` too"),
    "l2core": ("_EXPORTS", False, "the package's lazy exports"),
    "l3pool.cache": ("_LAZY", False, "the package's lazy exports"),
    "l3pool.index": ("_LAZY", False, "the package's lazy exports"),
    "l3pool.demo": ("_EXPORTS", False, "what the demo lends the benchmarks, loaded on first use"),
}
# modules a decode node imports without torch (and the TP-shared segment janitor, which starts as
# its own process): neither they nor anything they import names torch
TORCH_FREE_ROOTS = (
    "l3pool.agent",
    "l3pool.cli",
    "l3pool.cliutil",
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


def _by_name(node: ast.Call) -> str | None:
    """The literal module name of `importlib.import_module("...")` / `import_module("...")` /
    `__import__("...")`, else None (a name computed at run time cannot be read here)."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _strings(nodes: list[ast.expr | None]) -> list[str]:
    return [e.value for e in nodes if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _table(node: ast.stmt, name: str) -> list[str]:
    """The module names of a module-level `name = ("a.b", ...)` (or a list), or of the values of
    `name = {"X": "a.b", **dict.fromkeys(("Y", "Z"), "a.c")}`; [] for any other statement."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    value = getattr(node, "value", None)
    if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
        return []
    if isinstance(value, ast.Tuple | ast.List):
        return _strings(list(value.elts))
    if not isinstance(value, ast.Dict):
        return []
    names = _strings([v for k, v in zip(value.keys, value.values, strict=True) if k is not None])
    for k, v in zip(value.keys, value.values, strict=True):  # `**dict.fromkeys(names, "module")`
        if k is None and isinstance(v, ast.Call) and len(v.args) == 2:
            names += _strings([v.args[1]])
    return names


def _imports(path: Path, module: str) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import statement of `path`, every
    import by a literal name and every name of its BY_NAME table."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    top_calls = {id(n.value) for n in tree.body if isinstance(n, ast.Expr | ast.Assign)}  # `m = import_module(...)`
    is_pkg = path.name == "__init__.py"
    package = module.split(".") if is_pkg else module.split(".")[:-1]
    if module in BY_NAME:
        table, at_top, _ = BY_NAME[module]
        for node in tree.body:
            for name in _table(node, table):
                yield name if "." in name else f"{'.'.join(package)}.{name}", node.lineno, at_top
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _by_name(node)) is not None:
            if name.startswith("."):  # import_module(".x", __package__): relative to this package
                level = len(name) - len(name.lstrip("."))
                name = ".".join([*package[: len(package) - (level - 1)], name.lstrip(".")])
            yield name, node.lineno, id(node) in top_calls
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package[: len(package) - (node.level - 1)]
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
    for pkg in SCANNED:
        for path in sorted((root / pkg).rglob("*.py")):
            if path.is_relative_to(root / "bench" / "results"):
                continue
            mod = _module_name(path, root)
            graph[mod] = [(t, line, top, path) for t, line, top in _imports(path, mod)]
    return graph


def _private_owner(name: str) -> str | None:
    """The package a private name belongs to: what precedes its first `_` component (dunders such
    as `__version__` are public), or None when it has none."""
    parts = name.split(".")
    i = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
    return None if i is None else ".".join(parts[:i])


def _bench_breaks(mod: str, target: str, graph: dict[str, object]) -> list[str]:
    """The BENCH_RULES that bench's module `mod` importing `target` breaks."""
    broken = []
    owner = _private_owner(target)
    if owner is not None and any(_under(target, lib) for lib in PACKAGES):
        broken.append("library_private")
    demo = "l3pool.demo"
    if _under(target, demo) and target != demo and (target.count(".") > demo.count(".") + 1 or target in graph):
        broken.append("demo_modules")  # l3pool.demo.X.Y, or l3pool.demo.X that is a module
    if owner is not None and _under(target, "bench") and not _under(mod, owner):
        broken.append("bench_helper")
    return broken


def violations(root: Path) -> list[str]:
    graph = import_graph(root)
    out = []
    for mod, edges in graph.items():
        for target, line, _, path in edges:
            where = f"{path.relative_to(root)}:{line}: {mod} imports {target}"
            allowed = any(_under(mod, a) and _under(target, b) for a, b in EXCEPT)
            for src, dst, why in NEVER:
                if _under(mod, src) and _under(target, dst) and not allowed:
                    out.append(f"{where} ({why})")
            for private, why in PRIVATE.items():
                inside = _under(mod, private) or _under(mod, "bench")  # bench: BENCH_RULES
                if _under(target, private) and not inside and not allowed:
                    out.append(f"{where} ({why})")
            if _under(mod, "bench"):
                out += [f"{where} ({BENCH_RULES[rule]})" for rule in _bench_breaks(mod, target, graph)]
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
    graph = import_graph(ROOT)
    assert len(graph) > 50 and "bench.scale._client" in graph  # the walk read the tree, bench/ too
    assert any(t == "l3pool.demo" for t, *_ in graph["l3pool.cli"])  # and the entry point's command table
    for pkg, only_in_its_table in (
        ("l2core", "l2core.layout"),
        ("l3pool.index", "l3pool.index.guard"),
        ("l3pool.demo", "l3pool.demo.interference"),
    ):  # and the lazy export tables
        assert any(t == only_in_its_table and not top for t, _, top, _ in graph[pkg]), pkg


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
        ({"l3pool/tools/purge.py": "def f():\n    from l3pool.cli import fail\n"}, "only the entry point"),
        ({"l3pool/cliutil.py": "def f():\n    from l3pool.cluster import local\n"}, "below every command"),
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
        # bench/: the library's public names only, the demo's exported names only
        ({"bench/cache.py": "def f():\n    from l2core import _native\n"}, "private module or name of the library"),
        ({"bench/cache.py": "from l3pool.cache.controller import _Entry\n"}, "private module or name"),
        ({"bench/interference.py": "def f():\n    from l3pool.demo.engine import PrefillInstance\n"}, "never a module"),
        ({"bench/interference.py": "from l3pool.demo import hf\n", "l3pool/demo/hf.py": ""}, "never a module"),
        ({"bench/transfer/__init__.py": "from l3pool.cli import main\n"}, "only the entry point"),
        ({"bench/scale/_client.py": "", "bench/index/__init__.py": "from bench.scale import _client\n"}, "belongs to"),
        ({"bench/l3_placement.py": "def f():\n    from bench.l3 import _fill\n"}, "belongs to the package"),
        # imports by name: a literal import_module / __import__, a BY_NAME table
        (
            {"l3pool/tools/chaos.py": "import importlib\ndef f():\n    importlib.import_module('l3pool.demo.run')\n"},
            "the demo is an application",
        ),
        ({"l3pool/pool/client.py": "def f():\n    __import__('l3pool.cache.controller')\n"}, "pool core never"),
        (
            {"l3pool/pool/client.py": "from importlib import import_module\nimport_module('..tools', __package__)\n"},
            "pool core never",
        ),
        (
            {
                "bench/prefill.py": "import importlib\nhf = importlib.import_module('l3pool.demo.hf')\n",
                "l3pool/demo/hf.py": "",
            },
            "never a module",
        ),
        (
            {"l3pool/cli.py": "_COMMANDS = ('l3pool.tools.doctor',)\n", "l3pool/tools/doctor.py": "import torch\n"},
            "imports torch at module level (reached from l3pool.cli)",
        ),
        ({"l3pool/cli.py": "_COMMANDS = ('l3pool.tools.doctor', 'bench.cache')\n"}, "never imports the benchmarks"),
        ({"l2core/__init__.py": "_EXPORTS = {'L3Client': 'l3pool.pool.client'}\n"}, "l2core is the floor under l3pool"),
        ({"l3pool/index/__init__.py": "_LAZY = {**dict.fromkeys(('A', 'B'), 'l3pool.cache.x')}\n"}, "stands beside"),
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
            "l3pool/__main__.py": "from l3pool.cli import main\n",
            "l3pool/cli.py": "_COMMANDS = ('l3pool.agent', 'l3pool.demo')\n",  # the entry point loads the demo
            "l3pool/demo/__init__.py": "import importlib\ndef f():\n    importlib.import_module('l3pool.demo.hf')\n",
            "l3pool/demo/hf.py": "import torch\n",
            "bench/interference.py": "from l3pool.demo import HFModel\nfrom l2core import load_native\n",
            "bench/cache.py": "import l3pool.__main__\nfrom l3pool import __version__\nfrom bench import _pool_cli\n",
            "bench/_pool_cli.py": "from l3pool.cliutil import guarded\n",
            "bench/scale/__init__.py": "from bench.scale._client import TraceSpec\nfrom ._obs import plot\n",
            "bench/scale/__main__.py": "from bench.scale import _terminate\n",
            "bench/scale/_client.py": "",
            "bench/scale/_obs.py": "",
        },
    )
    assert violations(root) == []

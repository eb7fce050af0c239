"""The docs name only what exists, and nothing names a place outside the repository.

Docs: README.md, docs/*.md, every other tracked README.md, and the results index
bench/results/README.md. Not the run notes (bench/results/<run>/README.md): they are history and
quote the tree as it was on the day of the run (a file since moved stays named as it was).

A doc names a repository path with a markdown link (relative to the doc, as a renderer resolves
it) or with a path anywhere in its text, backticked or not, that starts with a top-level
directory of the repository (`l3pool/cache/README.md`, `bash scripts/demo.sh`,
`bench/results/2026-12-01-cpu-demo/`). Such a path is read up to the first character that cannot
be part of one, so a placeholder ends it (`bench/results/<run>/` is checked as `bench/results/`),
and a `:line` or pytest `::test` suffix is dropped.

Every tracked file except the run notes under bench/results/ (history) must not name the
machines it was written on: a sibling checkout beside the repository, a shared design note or tool
directory there, an absolute path into the build machine's workspace (the patterns in OUTSIDE).
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = "bench/results/"
# paths the docs may name that a checkout does not hold, each with its reason
NOT_IN_A_CHECKOUT = {
    "l2core/native/": "the wheel's copy of native/, made by the build (setup.py, pyproject.toml)",
    "l2core/native": "the wheel's copy of native/, made by the build (setup.py, pyproject.toml)",
}
# places outside the repository (built from parts so this file names none of them itself)
_SHARED, _WORK = "sha" + "red", "wo" + "rk"
OUTSIDE = [
    re.compile(r"\.\./" + _SHARED),
    re.compile(r"(?<![\w.-])" + _SHARED + r"/(DESIGN\.md|tools)"),
    re.compile(r"(?<![\w.~-])/" + _WORK + r"(/|\b)"),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH_CHARS = r"[A-Za-z0-9_.\-/]"


@cache
def tracked() -> tuple[str, ...]:
    try:
        cmd = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True, timeout=60).stdout.decode()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the tracked files are unknown")
    return tuple(p for p in out.split("\0") if p and (ROOT / p).exists())


@cache
def tree() -> frozenset[str]:
    """Every tracked (or new, not ignored) file and every directory above one (directories end in "/")."""
    out: set[str] = set()
    for p in tracked():
        out.add(p)
        parts = p.split("/")
        for i in range(1, len(parts)):
            out.add("/".join(parts[:i]) + "/")
    return frozenset(out)


def docs() -> list[str]:
    out = ["README.md", *sorted(p for p in tracked() if p.startswith("docs/") and p.endswith(".md"))]
    out += sorted(
        p
        for p in tracked()
        if p.endswith("README.md") and p != "README.md" and not p.startswith(HISTORY) and not p.startswith("docs/")
    )
    if f"{HISTORY}README.md" in tracked():
        out.append(f"{HISTORY}README.md")
    return out


def exists(path: str) -> bool:
    path = path.rstrip(".,;:")
    if not path or path in NOT_IN_A_CHECKOUT:
        return True
    t = tree()
    return path in t or path.rstrip("/") in t or path.rstrip("/") + "/" in t


def named_paths(doc: str, text: str) -> list[tuple[int, str]]:
    """(line, repository path) of every path the doc names."""
    tops = sorted({p.split("/")[0] for p in tracked() if "/" in p}, key=len, reverse=True)
    bare = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(map(re.escape, tops))})/{PATH_CHARS}*)")
    here = Path(doc).parent
    out: list[tuple[int, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor of this page
            rel = (here / target.split("#")[0]).as_posix()
            norm = Path(rel).as_posix()
            parts: list[str] = []
            for part in norm.split("/"):
                if part == "..":
                    if not parts:
                        out.append((n, f"{target} (leaves the repository)"))
                        break
                    parts.pop()
                elif part not in ("", "."):
                    parts.append(part)
            else:
                out.append((n, "/".join(parts) + ("/" if target.endswith("/") else "")))
        for m in bare.finditer(LINK.sub(lambda k: k.group(0)[: k.start(1) - k.start(0)] + ")", line)):
            out.append((n, re.split(r"::|:\d", m.group(1))[0]))
    return out


def test_the_docs_are_found() -> None:
    found = docs()
    assert found[0] == "README.md" and "docs/design.md" in found and "l3pool/cache/README.md" in found
    assert not [d for d in found if d.startswith(HISTORY) and d != f"{HISTORY}README.md"]


def test_every_path_a_doc_names_exists() -> None:
    missing = []
    for doc in docs():
        for n, path in named_paths(doc, (ROOT / doc).read_text()):
            if "(leaves the repository)" in path or not exists(path):
                missing.append(f"{doc}:{n}: {path}")
    assert not missing, "paths named in the docs that the repository does not have:\n" + "\n".join(missing)


def test_the_path_check_can_fail() -> None:
    text = "see `l3pool/no_such_module.py` and [the design](docs/nowhere.md), `bench/results/<run>/`\n"
    paths = [p for _, p in named_paths("README.md", text)]
    assert paths == ["docs/nowhere.md", "l3pool/no_such_module.py", "bench/results/"]
    assert [exists(p) for p in paths] == [False, False, True]
    rel = [p for _, p in named_paths("l3pool/cache/README.md", "[up](../README.md) [out](../../../x)")]
    assert rel == ["l3pool/README.md", "../../../x (leaves the repository)"]


def test_nothing_names_a_place_outside_the_repository() -> None:
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    found = []
    for p in tracked():
        if p.startswith(HISTORY) or p == me:
            continue
        try:
            text = (ROOT / p).read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            continue  # binary (plots, wheels)
        for n, line in enumerate(text.splitlines(), 1):
            if any(r.search(line) for r in OUTSIDE):
                found.append(f"{p}:{n}: {line.strip()[:160]}")
    assert not found, "references to places outside the repository:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("line", "outside"),
    [
        (f"see ../{_SHARED}/DESIGN.md", True),
        (f"bash {_SHARED}/tools/gpu-bundle.sh", True),
        (f"the bundle: /{_WORK}/.library/device/KINDS.md", True),
        ("bash scripts/gpu-bundle.sh gpu-bundle", False),
        ("l3pool.cache.shared (SharedTieredCache), l2core/shm_segment.py", False),
        ("~/work/x and https://example.org/work/y", False),
    ],
)
def test_the_outside_check_can_fail(line: str, outside: bool) -> None:
    assert any(r.search(line) for r in OUTSIDE) is outside


def test_the_readme_is_a_guide_with_the_three_uses_on_its_first_screen() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: run histories go to bench/results/, the rest to docs/"
    first = "\n".join(lines[:60])
    for what in (
        "bash scripts/demo.sh",  # the two set-up commands
        "bash scripts/test.sh",
        "--hicache-storage-backend dynamic",  # 1. SGLang
        '"module_path":"l3pool.adapters.sglang_hicache"',
        "l3pool prefetch-check",  # 2.
        "l3pool inspect",  # 3.
        "NAMESPACES",
    ):
        assert what in first, f"{what!r} is not on the README's first screen (60 lines)"

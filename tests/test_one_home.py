"""One home per concept: the source tree is grepped for hand-rolled copies of what has one home.

- page ids -> token slots: `l2core.l1.page_slots` / `slot_pages`
- L1 buffer allocation: `l2core.l1.kv_buffers` / `kv_stack`
- a page hash's 64-bit key and the joined hash buffer: `l3pool.pool.keys.hash_keys` / `hash_key` /
  `join_hashes` / `split_hashes`
- the etcd and mooncake_master command lines: `l3pool.cluster.servers.etcd_argv` / `master_argv`

Each rule is a regex over the lines of the files it covers; a match outside the home (and the
few listed exceptions, each with its reason) fails with file:line. A planted copy in a throw-away
tree shows each rule can fail. Tests may spell a definition out as their oracle (the key rule and
the buffer rule cover the library and the benchmarks only); no test builds a server command line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("l2core", "l3pool", "bench")
EVERYTHING = (*LIBRARY, "tests")


@dataclass(frozen=True)
class Rule:
    concept: str
    home: str  # the module (path) that is the one implementation
    defines: tuple[str, ...]  # the functions the home defines for it
    pattern: re.Pattern[str]
    roots: tuple[str, ...]
    exempt: tuple[tuple[str, str], ...] = ()  # (path, why)


RULES = (
    Rule(
        "page ids -> token slots",
        "l2core/l1.py",
        ("page_slots", "slot_pages"),
        re.compile(r"\[:, *None\] *\* *[A-Za-z_.()]+ *\+ *[A-Za-z_.]*arange"),
        EVERYTHING,
        (("l2core/layout.py", "byte strides of the (kv, layer) runs of a host page, not token slots"),),
    ),
    Rule(
        "L1 buffer allocation",
        "l2core/l1.py",
        ("kv_buffers", "kv_stack"),
        re.compile(r"torch\.(zeros|empty)\(.*heads, *[A-Za-z_.]*dim\b"),
        LIBRARY,
    ),
    Rule(
        "16-byte hash -> 64-bit key, hash buffer split",
        "l3pool/pool/keys.py",
        ("hash_keys", "hash_key", "join_hashes", "split_hashes"),
        re.compile(r"<u8\"?\)? *\[(0 *)?::|int\.from_bytes\([^)]*\[: *8\]|dtype=f?\"V(16|\{HASH_BYTES\})\""),
        LIBRARY,
    ),
    Rule(
        "etcd / mooncake_master command lines",
        "l3pool/cluster/servers.py",
        ("etcd_argv", "master_argv"),
        re.compile(
            r"\"--initial-cluster-state\"|\"--listen-peer-urls\", |f\"--rpc_port=|\"--rpc_port\", "
            r"|f\"--http_metadata_server_port=|\"--http_metadata_server_port\", "
            r"|f\"--metrics_port=|\"--metrics_port\", "
        ),
        EVERYTHING,
        (("tests/l3pool/cluster/test_server_argv.py", "the home's own test: the exact argv it must build"),),
    ),
)


def copies(root: Path) -> list[str]:
    out = []
    for rule in RULES:
        skip = {rule.home, *(p for p, _ in rule.exempt), "tests/test_one_home.py"}
        for top in rule.roots:
            for path in sorted((root / top).rglob("*.py")):
                rel = path.relative_to(root).as_posix()
                if rel in skip:
                    continue
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    if rule.pattern.search(line):
                        out.append(f"{rel}:{n}: {rule.concept} has its home in {rule.home}: {line.strip()}")
    return out


def test_every_concept_has_one_home() -> None:
    found = copies(ROOT)
    assert not found, "copies of a concept outside its home:\n" + "\n".join(found)
    for rule in RULES:  # the homes exist and still define what their concept's users call
        text = (ROOT / rule.home).read_text()
        for name in rule.defines:
            assert re.search(rf"^def {name}\(", text, re.M), f"{rule.home} no longer defines {name}"
        for path, _ in rule.exempt:
            assert (ROOT / path).is_file(), f"stale exemption {path}"


@pytest.mark.parametrize(
    ("path", "text", "concept"),
    [
        ("l3pool/demo/x.py", "s = (p[:, None] * P + torch.arange(P)[None, :]).reshape(-1)\n", "token slots"),
        ("tests/l2core/x.py", "return (p[:, None] * self.page_size + self._arange[None, :])\n", "token slots"),
        ("bench/x.py", "b = torch.zeros(n * P, spec.heads, spec.dim, dtype=d)\n", "L1 buffer"),
        ("l3pool/cache/x.py", 'k = np.frombuffer(b"".join(hs), dtype="<u8")[::2]\n', "64-bit key"),
        ("l3pool/cache/x.py", 'return int.from_bytes(h[:8], "little")\n', "64-bit key"),
        ("bench/x.py", 'hs = np.frombuffer(raw, dtype="V16").tolist()\n', "64-bit key"),
        ("tests/l3pool/x.py", 'cmd = [exe, "--rpc_port", str(rpc)]\n', "command lines"),
        ("l3pool/tools/x.py", 'argv = [b, f"--metrics_port={p}"]\n', "command lines"),
        ("tests/x.py", 'a = ["--initial-cluster-state", "new"]\n', "command lines"),
    ],
)
def test_a_planted_copy_is_found(tmp_path: Path, path: str, text: str, concept: str) -> None:
    for top in EVERYTHING:
        (tmp_path / top).mkdir()
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(text)
    found = copies(tmp_path)
    assert len(found) == 1 and concept in found[0] and found[0].startswith(f"{path}:1: "), found

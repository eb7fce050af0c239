"""A demo run split into parts, one process (one device call) each: `l3pool demo --parts N`.

A part runs the warm-up and a contiguous block of the interleaved rounds (each round is
self-contained: fresh instances, a namespace of its own) and writes what summary.py needs of them
to `OUT/parts/part-K.json`; the last part also runs what follows the rounds (routing, fit,
interference, HF reference, side study), then merges every part into the report. The same command
is run N times; each run does the first part missing from OUT/parts. With every part there, the
command only merges (no measurement).

A part is refused, and a merge too, when the run dir holds parts of another run: the demo's
options, the code (a digest of l2core's and l3pool's sources) and the hardware (device, torch and
CUDA versions) must be the same in every part (`setup.json`, written by part 1). Parts may still
run on different machines of one kind; each part's host and device are in the report's `parts`.
The no-cache reference logits of every part are compared across parts
(`references_identical_across_parts`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from l3pool.demo.engine import CONFIGS, Record

if TYPE_CHECKING:
    from l3pool.demo.replay import DemoOptions, QueueRun, Verifier

FORMAT = 1
SOURCES = (".py", ".cpp", ".cu", ".h", ".hpp", ".c")
_RECORD_FIELDS = tuple(f.name for f in fields(Record) if f.repr)  # the scalars (tensors and hashes are repr=False)


class PartsError(ValueError):
    """A run dir that does not hold parts of this run, or a part file that is not one."""


def code_digest() -> str:
    """sha256 over the sources of l2core and l3pool (relative path + bytes), first 16 hex digits."""
    import l2core
    import l3pool

    h = hashlib.sha256()
    for pkg in (l2core, l3pool):
        root = Path(str(pkg.__file__)).resolve().parent
        for p in sorted(q for q in root.rglob("*") if q.suffix in SOURCES and "__pycache__" not in q.parts):
            h.update(f"{pkg.__name__}/{p.relative_to(root).as_posix()}\0".encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def hardware(device: str) -> dict[str, Any]:
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda}


def fingerprint(opts: DemoOptions) -> dict[str, Any]:
    """What every part of one run must share: options, code, hardware."""
    return {"options": json.loads(json.dumps(asdict(opts), default=str)), "code": code_digest(),
            "hardware": hardware(opts.device)}  # fmt: skip


def _differences(a: dict[str, Any], b: dict[str, Any], where: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{where}{k}.")
        elif x != y:
            out.append(f"{where}{k}: {x!r} there, {y!r} here")
    return out


def blocks(rounds: int, parts: int) -> list[list[int]]:
    """The rounds of each part: contiguous, as even as can be, the last part's last."""
    if not 1 <= parts <= rounds:
        raise PartsError(f"--parts {parts} with --rounds {rounds}: each part runs at least one round")
    return [list(range(k * rounds // parts, (k + 1) * rounds // parts)) for k in range(parts)]


def runs_to_json(runs: dict[str, list[QueueRun]], colds: dict[str, list[list[Record]]]) -> dict[str, Any]:
    def rec(r: Record) -> dict[str, Any]:
        return {k: getattr(r, k) for k in _RECORD_FIELDS}

    return {
        "runs": {c: [{"recs": [rec(r) for r in q.recs], "stats": q.stats, "logits_identical": q.logits_identical,
                      "logits_compared": q.logits_compared, "wrong_pages": q.wrong_pages} for q in runs[c]]
                 for c in CONFIGS},
        "colds": {c: [[rec(r) for r in rnd] for rnd in colds[c]] for c in CONFIGS},
    }  # fmt: skip


def runs_from_json(d: dict[str, Any]) -> tuple[dict[str, list[QueueRun]], dict[str, list[list[Record]]]]:
    from l3pool.demo.replay import QueueRun

    def rec(x: dict[str, Any]) -> Record:
        return Record(**{k: x[k] for k in _RECORD_FIELDS})

    runs = {c: [QueueRun([rec(r) for r in q["recs"]], q["stats"], q["logits_identical"], q["logits_compared"],
                         q["wrong_pages"]) for q in d["runs"][c]] for c in CONFIGS}  # fmt: skip
    colds = {c: [[rec(r) for r in rnd] for rnd in d["colds"][c]] for c in CONFIGS}
    return runs, colds


def logits_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


COUNTERS = ("compared", "mismatched_logits", "forward_variance", "pages_checked", "wrong_pages")


def verifier_to_json(v: Verifier) -> dict[str, Any]:
    return {**{k: getattr(v, k) for k in COUNTERS}, "mismatches": v.mismatches,
            "references": {str(i): logits_digest(t) for i, t in sorted(v.logits.items())}}  # fmt: skip


@dataclass
class RunDir:
    """OUT/parts of a run split into `count` parts."""

    path: Path
    count: int
    opts: DemoOptions

    def __post_init__(self) -> None:
        self.blocks = blocks(self.opts.rounds, self.count)
        self.fp = fingerprint(self.opts)

    def file(self, k: int) -> Path:
        return self.path / f"part-{k + 1}.json"

    def check(self) -> None:
        """Refuses a run dir that holds another run's parts (or another split of this one)."""
        setup = self.path / "setup.json"
        if not setup.exists():
            if any(self.path.glob("part-*.json")):
                raise PartsError(f"{self.path} holds part files but no setup.json: not a run this command can resume; "
                                 "use another --out or remove the directory")  # fmt: skip
            return
        there = self._load(setup)
        if there.get("parts") != self.count:
            raise PartsError(f"{self.path} holds a run in {there.get('parts')} parts, not {self.count} (--parts): "
                             "use the same --parts, another --out, or remove the directory")  # fmt: skip
        diff = _differences(there.get("fingerprint", {}), self.fp)
        if diff:
            raise PartsError(f"{self.path} holds parts of another run ({'; '.join(diff[:4])}"
                             f"{'; ...' if len(diff) > 4 else ''}): the same options, code and hardware "
                             "in every part, or another --out")  # fmt: skip

    def next_part(self) -> int | None:
        """The first part without a file (None: every part is there, only the merge is left)."""
        self.check()
        return next((k for k in range(self.count) if not self.file(k).exists()), None)

    def start(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        if not (self.path / "setup.json").exists():
            _write(self.path / "setup.json", {"format": FORMAT, "parts": self.count, "fingerprint": self.fp})

    def save(self, k: int, runs: dict[str, list[QueueRun]], colds: dict[str, list[list[Record]]], v: Verifier,
             elapsed_s: float, final: dict[str, Any] | None = None) -> None:  # fmt: skip
        _write(self.file(k), {
            "format": FORMAT, "part": k + 1, "parts": self.count, "rounds": self.blocks[k], "fingerprint": self.fp,
            "host": socket.gethostname(), "device": self.fp["hardware"]["device"],
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "elapsed_s": round(elapsed_s, 2),
            **runs_to_json(runs, colds), "verifier": verifier_to_json(v), "final": final,
        })  # fmt: skip

    def merged(self, need_final: bool = True) -> dict[str, Any]:
        """Every part's rounds in order, the verifier counters summed, the last part's final phases
        (`need_final`: a last part without them is refused)."""
        self.check()
        parts = [self._load(self.file(k)) for k in range(self.count)]
        runs: dict[str, list[QueueRun]] = {c: [] for c in CONFIGS}
        colds: dict[str, list[list[Record]]] = {c: [] for c in CONFIGS}
        counts = dict.fromkeys(COUNTERS, 0)
        mismatches: list[dict[str, Any]] = []
        refs: dict[str, set[str]] = {}
        for k, p in enumerate(parts):
            if p.get("rounds") != self.blocks[k] or _differences(p.get("fingerprint", {}), self.fp):
                raise PartsError(f"{self.file(k)} is part {p.get('part')} of another run or split: remove it and run "
                                 f"part {k + 1} again")  # fmt: skip
            try:
                r, c = runs_from_json(p)
                for cfg in CONFIGS:
                    runs[cfg] += r[cfg]
                    colds[cfg] += c[cfg]
                for n in COUNTERS:
                    counts[n] += int(p["verifier"][n])
                mismatches += p["verifier"]["mismatches"]
                for i, d in p["verifier"]["references"].items():
                    refs.setdefault(i, set()).add(d)
            except (KeyError, TypeError, ValueError) as e:
                raise PartsError(f"{self.file(k)} is not a demo part ({type(e).__name__}: {e}): remove it and run "
                                 f"part {k + 1} again") from None  # fmt: skip
        final = parts[-1].get("final")
        if need_final and not isinstance(final, dict):
            raise PartsError(
                f"{self.file(self.count - 1)} has no final phases: remove it and run part {self.count} again"
            )
        keep = ("rounds", "host", "device", "finished", "elapsed_s")
        summary = [{"part": k + 1, **{n: p.get(n) for n in keep}} for k, p in enumerate(parts)]
        return {"runs": runs, "colds": colds, "counts": counts, "mismatches": mismatches, "final": final,
                "parts": summary, "references_identical_across_parts": all(len(s) == 1 for s in refs.values()),
                "elapsed_s": round(sum(float(p.get("elapsed_s") or 0) for p in parts), 2)}  # fmt: skip

    def _load(self, f: Path) -> dict[str, Any]:
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise PartsError(f"{f}: cannot read it ({e}): remove it and run that part again") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise PartsError(f"{f} is not a demo part file of format {FORMAT}: remove it and run that part again")
        return d


def _write(f: Path, d: dict[str, Any]) -> None:
    """Whole or not at all: a part cut off while writing leaves no file (it runs again)."""
    tmp = f.with_name(f".{f.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(d, indent=1) + "\n")
    os.replace(tmp, f)

"""`l3pool demo --attention hybrid`: the `swa` section (l3pool.demo.swa) over the demo's pool.

Starts (or joins) the pool as the demo does, replays the agentic trace with the hybrid reference
model once per save-stride policy, prints the table (or `--json`) and writes `report.json` with
the `swa` section into `--out`. Exit code 0 only when every policy's logits equal the no-cache
reference and no hit page had wrong bytes (the hit/bytes target is reported, not enforced).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def options(a: argparse.Namespace) -> Any:
    import torch

    from l3pool.demo.model import ModelConfig
    from l3pool.demo.swa import SwaOptions
    from l3pool.demo.workload import WorkloadConfig

    device = "cuda" if a.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    model = ModelConfig(attention="mha", layers=a.layers or 6, hidden=64, heads=2, head_dim=32, kv_heads=1,
                        mlp=128, vocab=8192, page_size=a.swa_page, seed=a.seed)  # fmt: skip
    wl = WorkloadConfig(
        sessions=a.sessions or 3, turns=a.turns or 4, min_context=a.min_context or 1024,
        max_context=a.max_context or 4096, reuse=a.reuse, vocab=model.vocab, seed=a.seed,
    )  # fmt: skip
    strides = tuple(x.strip() for x in a.strides.split(";") if x.strip())
    return SwaOptions(model=model, swa_per_full=a.swa_per_full, window=a.swa_window, workload=wl,
                      strides=strides, rounds=a.rounds or 2, device=device)  # fmt: skip


def run_cli(a: argparse.Namespace, endpoints: Callable[[argparse.Namespace], Any]) -> int:
    import torch

    from l2core.spec import ConfigError
    from l3pool.cliutil import fail
    from l3pool.demo.swa import run_swa, table
    from l3pool.pool.store import StoreError

    torch.set_flush_denormal(True)
    try:
        opts = options(a)
        with endpoints(a) as (ep, how):
            store = ep.store()
            try:
                sec = run_swa(opts, store, tenant=f"swa{uuid.uuid4().hex[:8]}")
            finally:
                store.close()
            sec["pool"] = how
    except (ConfigError, StoreError, ValueError, RuntimeError) as e:
        return fail("l3pool demo", str(e))
    bad = [f"{r['stride']}: logits differ or {r['wrong_pages']} wrong pages" for r in sec["rows"]
           if not r["logits_identical"] or r["wrong_pages"]]  # fmt: skip
    rep = {"swa": sec, "ok": not bad}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print(table(sec))
        print(f"report: {a.out / 'report.json'}")
    for b in bad:
        print(f"l3pool demo: FAILED: {b}", file=sys.stderr)
    return 0 if not bad else 1

"""bench.transfer's report side: target evaluation, the text table, and what the machine was
doing (device description, CPU interference, git state, load average)."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Targets of the issue, evaluated on the row ratio (the "auto" method) of correct rows.
CUDA_LARGE_TOKENS, CUDA_LARGE_MIN_RATIO = 32768, 0.95
CUDA_SMALL_TOKENS, CUDA_SMALL_MIN_RATIO, CUDA_SMALL_MAX_SMS = 1024, 0.90, 16
CPU_MIN_TOKENS, CPU_MIN_RATIO = 8192, 0.80


def evaluate_targets(rows: Sequence[dict[str, Any]], device_type: str) -> dict[str, Any]:
    if device_type == "cuda":
        criteria = [
            f"tokens >= {CUDA_LARGE_TOKENS}: ratio >= {CUDA_LARGE_MIN_RATIO}",
            f"tokens <= {CUDA_SMALL_TOKENS}: ratio >= {CUDA_SMALL_MIN_RATIO} with sms <= {CUDA_SMALL_MAX_SMS}",
            "other sizes: no target; every evaluated row must also be correct",
        ]
    else:
        criteria = [
            f"tokens >= {CPU_MIN_TOKENS}: ratio >= {CPU_MIN_RATIO}",
            "other sizes: no target; every evaluated row must also be correct",
        ]
    out_rows = []
    for r in rows:
        req: dict[str, Any] | None = None
        if device_type == "cuda":
            if r["tokens"] >= CUDA_LARGE_TOKENS:
                req = {"min_ratio": CUDA_LARGE_MIN_RATIO}
            elif r["tokens"] <= CUDA_SMALL_TOKENS:
                req = {"min_ratio": CUDA_SMALL_MIN_RATIO, "max_sms": CUDA_SMALL_MAX_SMS}
        elif r["tokens"] >= CPU_MIN_TOKENS:
            req = {"min_ratio": CPU_MIN_RATIO}
        passed: bool | None = None
        if req is not None:
            ratio = r["ratio"]
            passed = (
                ratio is not None
                and ratio >= req["min_ratio"]
                and r["sms"] <= req.get("max_sms", r["sms"])
                and r["correct"] is True
            )
        out_rows.append(
            {
                "model": r["model"],
                "layout": r["layout"],
                "direction": r["direction"],
                "tokens": r["tokens"],
                "method": r["method"],
                "ratio": _round(r["ratio"], 4),
                "sms": r["sms"],
                "correct": r["correct"],
                "required": req,
                "pass": passed,
            }
        )
    judged = [t["pass"] for t in out_rows if t["pass"] is not None]
    return {
        "criteria": criteria,
        "rows": out_rows,
        "evaluated": len(judged),
        "passed": sum(bool(p) for p in judged),
        "pass": all(judged) if judged else None,
    }


# --------------------------------------------------------------------------------------------
# output


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


def _rounded(obj: Any) -> Any:
    """GBps to 3 decimals, ratios to 4, times to 4."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if isinstance(v, float):
                nd = 4 if ("ratio" in k or k.startswith("ms") or k.endswith("_s")) else 3
                out[k] = round(v, nd)
            elif isinstance(v, list) and v and isinstance(v[0], float):
                out[k] = [round(x, 4) for x in v]
            else:
                out[k] = _rounded(v)
        return out
    if isinstance(obj, list):
        return [_rounded(x) for x in obj]
    return obj


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def format_table(report: dict[str, Any]) -> str:
    cuda = report["device_type"] == "cuda"
    targets = {(t["model"], t["layout"], t["direction"], t["tokens"]): t for t in report["targets"]["rows"]}
    head = ["model", "layout", "dir", "tokens", "method", "GB/s", "raw GB/s", "ratio", "SMs" if cuda else "thr"]
    if cuda:
        head += ["direct", "staged", "best"]
    head += ["naive", "n.ratio", "dma", "d.ratio", "ok", "target"]
    lines = [head]
    for r in report["results"]:
        t = targets[(r["model"], r["layout"], r["direction"], r["tokens"])]
        line = [
            r["model"],
            r["layout"],
            r["direction"],
            str(r["tokens"]),
            r["method"],
            _fmt(r["GBps"], ".2f"),
            _fmt(r["raw_GBps"], ".2f"),
            _fmt(r["ratio"], ".3f"),
            str(r["sms"]),
        ]
        if cuda:
            line += [
                _fmt(r["methods"]["direct"]["GBps"], ".2f"),
                _fmt(r["methods"]["staged"]["GBps"], ".2f"),
                str(r["best_method"]),
            ]
        line += [
            _fmt(r["naive_GBps"], ".2f"),
            _fmt(r["naive_ratio"], ".3f"),
            _fmt(r["dma_GBps"], ".2f"),
            _fmt(r["dma_ratio"], ".3f"),
            "yes" if r["correct"] else "NO",
            "-" if t["pass"] is None else ("pass" if t["pass"] else "FAIL"),
        ]
        lines.append(line)
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text = [
        "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(x, widths, strict=True)))
        for x in lines
    ]
    tg = report["targets"]
    summary = [
        f"device: {report['device']}   torch {report['torch']}   {report['date']}",
        "raw GB/s (largest size): " + ", ".join(f"{k} {v:.2f}" for k, v in report["raw_GBps"].items()),
        "targets: " + "; ".join(tg["criteria"]),
        f"targets overall: {_verdict(tg['pass'])} ({tg['passed']}/{tg['evaluated']} evaluated rows pass)",
        f"runtime {report['runtime_s']:.1f} s, peak RSS {report['peak_rss_GB']:.2f} GB",
    ]
    git = report.get("git")
    if git:
        dirty = ", ".join(git["uncommitted_l2core_native"]) or "none"
        summary.append(f"git {git['commit'][:12]}, uncommitted in l2core/ and native/: {dirty}")
    inter = report.get("interference")
    if inter:
        summary.append(
            f"other processes used {inter['other_processes_cpu_s']:.1f} CPU-s during the run "
            f"(steal {inter['steal_s']:.1f} s, {inter['available_cpu_s']:.0f} CPU-s available)"
        )
    return "\n".join([*text[:1], "-" * len(text[0]), *text[1:], "", *summary])


def _verdict(p: bool | None) -> str:
    return "n/a (no row has a target)" if p is None else ("PASS" if p else "FAIL")


def device_description(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"cpu: {name}, {threads} threads"


# --------------------------------------------------------------------------------------------
# main


def _cpu_times() -> tuple[float, float, float] | None:
    """(busy CPU-seconds of the whole machine, steal seconds, this process's CPU-seconds)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (user + nice + system + irq + softirq) / hz, steal / hz, ru.ru_utime + ru.ru_stime


def _interference(t0: tuple[float, float, float] | None, wall_s: float) -> dict[str, Any] | None:
    """CPU time other processes (and the hypervisor, as steal) took during the run."""
    t1 = _cpu_times()
    if t0 is None or t1 is None:
        return None
    return {
        "other_processes_cpu_s": max(0.0, (t1[0] - t0[0]) - (t1[2] - t0[2])),
        "steal_s": t1[1] - t0[1],
        "available_cpu_s": wall_s * (os.cpu_count() or 1),
    }


def _git_state() -> dict[str, Any] | None:
    """The commit measured, and which files of l2core/ and of its kernels' sources (native/) differ from it."""
    root = Path(__file__).resolve().parents[2]  # the checkout: bench/transfer/_report.py
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "l2core", "native"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "uncommitted_l2core_native": [line[3:] for line in dirty]}

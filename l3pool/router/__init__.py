"""The cache-aware router: an expected TTFT per instance from its tier hits (l3pool.index), each
tier's measured fetch bandwidth, its fitted prefill compute and its queued work; policies
`cache_aware` (ours, the default: DEFAULT_POLICY: the lowest marginal cost with work
conservation), and as baselines `round_robin`, `dynamo_like` (fixed tier weights) and
`sglang_like` (SGLang's cache-aware router: its own approximate prefix trees, shortest queue when
imbalanced).

A floor of its own: it imports l3pool.index's types and nothing else of l3pool (no torch), so an
engine's scheduler or a frontend can embed it; the opt-in l3pool.router.metrics (not imported here)
adds l3pool.metrics, pure Python. See router.py for the API.
"""

from l3pool.router.model import Bandwidth, ComputeModel, InstanceModel, RouterError
from l3pool.router.policy import (
    DEFAULT_POLICY,
    POLICIES,
    CacheAware,
    DynamoLike,
    Estimate,
    Policy,
    RoundRobin,
    SglangLike,
    make_policy,
)
from l3pool.router.router import Decision, PrefetchOrder, Router

__all__ = [
    "DEFAULT_POLICY", "POLICIES", "Bandwidth", "CacheAware", "ComputeModel", "Decision", "DynamoLike", "Estimate",
    "InstanceModel", "Policy", "PrefetchOrder", "RoundRobin", "Router", "RouterError", "SglangLike",
    "make_policy",
]  # fmt: skip

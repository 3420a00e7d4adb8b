"""Prometheus metrics of the weight-broadcaster."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REFITS = Counter(
    "molt_broadcaster_refits_total",
    "Refits by outcome: ok; rejected (before anything paused: bad input, no engine, router out of reach); "
    "refused (validation failed, the old weights serve again); failed_paused; timeout; abandoned; error.",
    ["outcome"],
)
OUTCOMES = ("ok", "rejected", "refused", "failed_paused", "timeout", "abandoned", "error")
REFIT_SECONDS = Histogram(
    "molt_broadcaster_refit_seconds",
    "Wall time of a refit, pause to resume.",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
REFIT_BYTES = Counter("molt_broadcaster_refit_bytes_total", "Bytes moved by refits.")
POLICY_VERSION = Gauge("molt_broadcaster_policy_version", "The newest published policy version.")

for _outcome in OUTCOMES:  # exported at 0 from the start, so rate() and alerts see every series
    REFITS.labels(outcome=_outcome)

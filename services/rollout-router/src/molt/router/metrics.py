"""The router's Prometheus metrics (served on ``metrics_port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS_IN_FLIGHT = Gauge("molt_router_requests_in_flight", "Requests routed to an engine and not finished.")
REQUESTS_WAITING = Gauge("molt_router_requests_waiting", "Requests held while the router is paused.")
REQUESTS = Counter("molt_router_requests_total", "Finished requests by outcome.", ["outcome"])
GENERATED_TOKENS = Counter("molt_router_generated_tokens_total", "Tokens sampled (rate = tokens/s).")
REQUEST_SECONDS = Histogram("molt_router_request_seconds", "Wall time of a request, admission to last token.")
FIRST_TOKEN_SECONDS = Histogram("molt_router_first_token_seconds", "Time from admission to the first token.")
ENGINES_UP = Gauge("molt_router_engines_up", "Engines started and answering.")
ENGINE_REPLACEMENTS = Counter("molt_router_engine_replacements_total", "Dead engines replaced by new ones.")
PROTECTED_IGNORED = Counter(
    "molt_router_protected_overrides_ignored_total",
    "Protected sampling values a request set and the router ignored.",
    ["field"],
)
PAUSED = Gauge("molt_router_paused", "1 while generation is paused.")
POLICY_VERSION = Gauge("molt_router_policy_version", "Policy version tokens are sampled with.")
SUBMIT_BATCH = Histogram(
    "molt_router_submit_batch_requests",
    "Requests handed to an engine per data-channel frame (those arriving in one pass of the event loop go together).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
ROUTING_BYTES = Counter(
    "molt_router_routing_bytes_total",
    "Bytes of routed-expert ids returned ([rollout] routing_replay); per token: divide by routing_tokens.",
)
ROUTING_TOKENS = Counter("molt_router_routing_tokens_total", "Tokens (prompt + sampled) whose routing was returned.")

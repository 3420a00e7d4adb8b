"""The agent-pool's Prometheus metrics (served on ``metrics_port``).

Training episodes and evaluation episodes are told apart by the ``purpose``
label ("train" | "eval"); eval episodes are never queued.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

EPISODES_STARTED = Counter("molt_agent_pool_episodes_started_total", "Episodes started.", ["purpose"])
EPISODES_FINISHED = Counter(
    "molt_agent_pool_episodes_finished_total", "Episodes that ended with tokens and a reward.", ["purpose"]
)
EPISODES_FAILED = Counter(
    "molt_agent_pool_episodes_failed_total",
    "Episodes that failed (never trained on), by reason: exception, timeout, router_unavailable, no_tokens, stopped.",
    ["purpose", "reason"],
)
EPISODES_IN_FLIGHT = Gauge("molt_agent_pool_episodes_in_flight", "Training episodes running now.")
AGENT_CALLS_OVERRUNNING = Gauge(
    "molt_agent_pool_agent_calls_overrunning",
    "Agent code still running after its episode ended (timed out or stopped): a plain method in its thread, "
    "or async code that ignored its cancellation.",
)
GROUPS_IN_FLIGHT = Gauge("molt_agent_pool_groups_in_flight", "Prompt groups running now.")
GROUPS_QUEUED = Counter("molt_agent_pool_groups_queued_total", "Groups written to the trajectory queue.")
TRAJECTORIES_QUEUED = Counter(
    "molt_agent_pool_trajectories_queued_total", "Trajectories (segments) written to the trajectory queue."
)
GROUPS_FILTERED = Counter(
    "molt_agent_pool_groups_filtered_total",
    "Groups not queued, by reason: all_pass, all_fail (dynamic filtering), no_episodes.",
    ["reason"],
)
BACKPRESSURED = Gauge("molt_agent_pool_backpressured", "1 while waiting for the learner (staleness bound).")
POLICY_VERSION = Gauge(
    "molt_agent_pool_policy_version", "The policy version last seen: the broadcaster's announcement, else the router's."
)
DATA_EPOCH = Gauge(
    "molt_agent_pool_data_epoch", "Epoch of the training dataset the newest prompt was taken from (0: the first pass)."
)
EVAL_REWARD = Gauge("molt_agent_pool_eval_mean_reward", "Mean reward of the latest held-out evaluation pass.")
EVAL_POLICY_VERSION = Gauge("molt_agent_pool_eval_policy_version", "Policy version of the latest evaluation pass.")
EVAL_PASSES = Counter("molt_agent_pool_eval_passes_total", "Evaluation passes completed.")
FRONT_REQUESTS = Counter(
    "molt_agent_pool_front_requests_total", "HTTP front requests by API and response status.", ["api", "status"]
)

FAILURE_REASONS = ("exception", "timeout", "router_unavailable", "no_tokens", "stopped")
FILTER_REASONS = ("all_pass", "all_fail", "no_episodes")
# Export every known series from the start (at 0), so dashboards and rate() see them before the first event.
for _purpose in ("train", "eval"):
    EPISODES_STARTED.labels(_purpose)
    EPISODES_FINISHED.labels(_purpose)
    for _reason in FAILURE_REASONS:
        EPISODES_FAILED.labels(_purpose, _reason)
for _reason in FILTER_REASONS:
    GROUPS_FILTERED.labels(_reason)

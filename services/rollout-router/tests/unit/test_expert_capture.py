"""The capture's bookkeeping (molt.router.expert_capture.RoutingRecorder) on hand-made steps: rows map to
(request, position), a position's first computation wins, the last row and uncaptured rows are -1."""

from __future__ import annotations

import numpy as np
import torch

from molt.router.expert_capture import RoutingRecorder, external_id, routing_array


def step(recorder: RoutingRecorder, rows: list[tuple[str, int, int]], finished: tuple[str, ...] = ()) -> None:
    """One engine step over ``(request, position, expert)`` rows, in batch order; layer ``l`` of a row
    picks experts ``(expert + l, expert + l + 1)``, so each row's value names it."""
    recorder.begin()
    experts = torch.tensor([e for _, _, e in rows])
    for layer in range(recorder.layers):
        recorder.capture(layer, torch.stack([experts + layer, experts + layer + 1], dim=1))
    req_ids: list[str] = []
    counts: list[int] = []
    for req_id, _, _ in rows:
        if req_ids and req_ids[-1] == req_id:
            counts[-1] += 1
        else:
            req_ids.append(req_id)
            counts.append(1)
    recorder.commit(req_ids, counts, np.array([p for _, p, _ in rows]), set(finished))


def test_rows_map_to_requests_and_positions() -> None:
    recorder = RoutingRecorder(layers=2, top_k=2)
    step(recorder, [("a-12345678", 0, 10), ("a-12345678", 1, 11), ("b-abcdefgh", 0, 20)])
    step(recorder, [("a-12345678", 2, 12), ("b-abcdefgh", 1, 21)])
    # b's last token was fed once (a step scheduled ahead of its finish, as under async scheduling).
    answer = recorder.take({"a": 4, "b": 2})
    a, b = routing_array(answer["a"]), routing_array(answer["b"])
    assert a.dtype == np.int16 and a.shape == (4, 2, 2)
    assert a[:3, 0, 0].tolist() == [10, 11, 12] and a[:3, 1].tolist() == [[11, 12], [12, 13], [13, 14]]
    assert b[0, 0, 0] == 20
    # The last token's row is -1, whether or not a forward computed it; nothing else is missing.
    assert (a[3] == -1).all() and (b[1] == -1).all()
    assert answer["a"]["missing"] == 0 and answer["b"]["missing"] == 0


def test_a_recompute_does_not_overwrite_the_first_computation() -> None:
    recorder = RoutingRecorder(layers=1, top_k=2)
    step(recorder, [("r-00000000", 0, 1), ("r-00000000", 1, 2), ("r-00000000", 2, 3)])
    step(recorder, [("r-00000000", 3, 4)])
    # Preempted, then re-prefilled from position 0 (or after a refit, under other weights).
    step(recorder, [("r-00000000", p, 50 + p) for p in range(5)])
    step(recorder, [("r-00000000", 5, 60)])
    routing = routing_array(recorder.take({"r": 7})["r"])
    assert routing[:, 0, 0].tolist() == [1, 2, 3, 4, 54, 60, -1]


def test_positions_no_forward_computed_are_minus_one_and_counted() -> None:
    recorder = RoutingRecorder(layers=1, top_k=2)
    step(recorder, [("r-00000000", 2, 7), ("r-00000000", 3, 8)])  # 0 and 1 came from elsewhere
    entry = recorder.take({"r": 5})["r"]
    assert routing_array(entry)[:, 0, 0].tolist() == [-1, -1, 7, 8, -1]
    assert entry["missing"] == 2


def test_take_forgets_and_ignores_unknown_requests() -> None:
    recorder = RoutingRecorder(layers=1, top_k=2)
    step(recorder, [("r-00000000", 0, 1)])
    assert set(recorder.take({"r": 2, "nobody": 3})) == {"r"}
    assert recorder.take({"r": 2}) == {}


def test_forward_outside_a_step_is_ignored() -> None:
    recorder = RoutingRecorder(layers=1, top_k=2)
    recorder.capture(0, torch.tensor([[1, 2]]))  # a warm-up forward: no execute_model around it
    assert recorder.step is None and recorder.requests == {}


def test_untaken_finished_requests_are_forgotten_oldest_first() -> None:
    recorder = RoutingRecorder(layers=1, top_k=2, kept_finished=2)
    for name in ("a", "b", "c"):
        step(recorder, [(f"{name}-00000000", 0, 1)])
    for name in ("a", "b", "c"):
        step(recorder, [], finished=(f"{name}-00000000",))
    assert sorted(recorder.requests) == ["b-00000000", "c-00000000"] and recorder.forgotten == 1


def test_external_id_strips_only_vllms_suffix() -> None:
    assert external_id("req-7-1a2b3c4d") == "req-7"
    assert external_id("plain") == "plain"
    assert external_id("a-short") == "a-short"

from __future__ import annotations

import numpy as np
import pytest

from molt.core import expert_routing


@pytest.mark.parametrize(("experts", "id_bytes"), [(8, 1), (255, 1), (256, 2), (512, 2)])
def test_pack_and_unpack_round_trip_with_none(experts: int, id_bytes: int) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, experts, size=(5, 3, 2)).astype(np.int16)
    ids[-1] = -1
    ids[1, 2] = -1
    packed = expert_routing.pack(ids, experts)
    assert packed.id_bytes == id_bytes
    assert len(packed.ids) == ids.size * id_bytes
    assert (packed.layer_count, packed.top_k) == (3, 2)
    np.testing.assert_array_equal(expert_routing.unpack(packed), ids)


def test_unreadable_routing_is_named() -> None:
    packed = expert_routing.pack(np.zeros((4, 2, 2), dtype=np.int16), 8)
    assert expert_routing.problem(packed, 4) is None
    assert "covers 4 tokens; the trajectory has 5" in str(expert_routing.problem(packed, 5))
    packed.ids = packed.ids[:-1]
    with pytest.raises(ValueError, match="not a multiple"):
        expert_routing.unpack(packed)
    packed.id_bytes = 3
    assert "id_bytes is 3" in str(expert_routing.problem(packed))


def test_the_first_computation_of_a_token_wins() -> None:
    earlier = np.array([[[1, 2]], [[3, 4]], [[-1, -1]]], dtype=np.int16)  # its last row: never fed
    later = np.array([[[5, 6]], [[3, 4]], [[7, 0]], [[2, 1]], [[-1, -1]]], dtype=np.int16)
    merged = expert_routing.first_wins(earlier, later)
    np.testing.assert_array_equal(merged[:, 0], [[1, 2], [3, 4], [7, 0], [2, 1], [-1, -1]])
    with pytest.raises(ValueError, match="does not prefix"):
        expert_routing.first_wins(later, earlier)

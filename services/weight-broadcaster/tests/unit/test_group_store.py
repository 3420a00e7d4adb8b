"""The weight group's store: it listens on ``store_host`` alone, and a peer without the run's token
can neither join the group nor release a refit (``molt.core.auth.store_namespace``).

Real TCPStore, real gloo groups in threads; the intruder is a peer that knows the store's address
(anyone who can reach the port does) but not the token."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import psutil
import torch

from molt.broadcaster.config import BroadcasterSettings
from molt.broadcaster.membership import Membership
from molt.core.auth import write_token
from molt.core.config import RunSettings
from molt.core.weightsync import ABANDONED, TensorMeta, WeightGroup, open_store, refit_keys


def membership(tmp_path: Path) -> Membership:
    write_token(tmp_path / "token")
    settings = BroadcasterSettings(run=RunSettings(token_file=tmp_path / "token"), store_host="127.0.0.1")
    member = Membership(settings, router=None)  # type: ignore[arg-type]  # the store needs no router
    member.open_store()
    return member


def group(port: int, rank: int, namespace: str, ready_key: str = "", join_s: float = 30) -> WeightGroup:
    return WeightGroup(
        "127.0.0.1", port, rank, 2, backend="gloo", generation=1, device=torch.device("cpu"),
        timeout_s=30, join_timeout_s=join_s, ready_key=ready_key, namespace=namespace,
    )  # fmt: skip


def test_the_store_listens_on_its_host_only(tmp_path: Path) -> None:
    member = membership(tmp_path)
    listening = [
        c.laddr for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == member.store_port
    ]  # fmt: skip
    assert [address.ip for address in listening] == ["127.0.0.1"]


def test_a_peer_without_the_token_cannot_join_or_release_a_refit(tmp_path: Path) -> None:
    member = membership(tmp_path)
    assert member.namespace and member.store is not None
    port, namespace = member.store_port, member.namespace
    _, ready_key = refit_keys("refit-1")
    intruder = open_store("127.0.0.1", port, timedelta(seconds=5))  # the address, no token
    intruder.set(ready_key, ABANDONED)  # would release the engines' wait for the learner, were it the run's key
    tensor = torch.arange(12, dtype=torch.float32)
    meta = [TensorMeta.of("w", tensor)]
    received: list[torch.Tensor] = []
    errors: list[BaseException] = []
    intruded: list[BaseException] = []

    def intrude() -> None:  # rank 1 of the same generation, while the real rank 1 and the sender join
        try:
            group(port, 1, "", join_s=5)
        except RuntimeError as exc:
            intruded.append(exc)

    def receiver() -> None:
        try:
            member_group = group(port, 1, namespace, ready_key=ready_key)
            received.extend(t.clone() for _, t in member_group.receive(meta, bucket_bytes=1024))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    stranger = threading.Thread(target=intrude)
    stranger.start()
    thread = threading.Thread(target=receiver)
    thread.start()
    member.store.set(ready_key, b"1")  # the learner on its way, in the run's namespace
    sender = group(port, 0, namespace)
    sender.send(meta, {"w": tensor}, bucket_bytes=1024)
    thread.join(timeout=60)
    stranger.join(timeout=60)
    assert not errors, errors
    assert len(received) == 1 and torch.equal(received[0], tensor)
    assert len(intruded) == 1  # it met nobody: the group's keys were out of its sight

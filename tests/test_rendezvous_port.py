"""The rendezvous port free_port hands out is held for the rendezvous: no other bind on the host gets it
until it is released, while torch's store listens on it as usual."""

from __future__ import annotations

import datetime
import errno
import socket

import pytest
import torch.distributed

from rltrain.megatron.parallel import free_port, release_port


def _bind_any() -> socket.socket:
    sock = socket.socket()
    sock.bind(("", 0))
    return sock


def test_no_bind_to_port_0_gets_a_held_port():
    """Ray's servers and other runs bind port 0: none of them may be given a port held for a rendezvous
    (with the port only found free and closed again, ~40 of these binds would land on one)."""
    held = [free_port() for _ in range(200)]
    others = [_bind_any() for _ in range(3000)]
    try:
        taken = {s.getsockname()[1] for s in others}
        assert not taken & set(held)
    finally:
        for s in others:
            s.close()
        for port in held:
            release_port(port)


def test_a_plain_bind_is_refused_and_torch_store_listens():
    port = free_port()
    try:
        with socket.socket() as sock, pytest.raises(OSError) as exc:
            sock.bind(("", port))
        assert exc.value.errno == errno.EADDRINUSE
        for libuv in (True, False):  # both of torch's store backends
            store = torch.distributed.TCPStore(
                "127.0.0.1", port, 1, True, datetime.timedelta(seconds=30), use_libuv=libuv
            )
            store.set("k", "v")
            assert store.get("k") == b"v"
            del store
    finally:
        release_port(port)
    with socket.socket() as sock:
        sock.bind(("", port))  # free again once released

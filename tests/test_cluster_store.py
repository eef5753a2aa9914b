"""The SplitFed store listens on the address it is given and nowhere else (splitlearn/cluster/store.py).

The attack: torch's TCPStore, handed ``127.0.0.1``, binds ``*:port`` (IPv4 and IPv6), and it
authenticates nobody, so anyone who can reach the machine could write ``splitlearn/fed/gen=999``,
fill or close a round, or touch gloo's rendezvous keys. ``host_store`` binds the socket itself;
the kernel's table (/proc/net/tcp{,6}) then shows the store on loopback only, and a connection
to the machine's other address is refused while loopback works.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta
from ipaddress import ip_address

import pytest

from splitlearn.cluster.store import host_store
from splitlearn.procs.localserver import free_port

from listening import on_port, public_address

LOOPBACK = ip_address("127.0.0.1")


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_torchs_own_store_would_listen_on_every_interface():
    """The control: the hole this module closes (if torch stops binding *:port, this says so)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    assert any(not a.is_loopback for a in on_port(store.port))
    addr = public_address()
    if addr is not None:
        assert not _refused(addr, store.port)


def test_the_store_listens_on_loopback_only_and_serves_there():
    import torch.distributed as dist

    store = host_store("127.0.0.1", 0)
    assert on_port(store.port) == [LOOPBACK]
    addr = public_address()
    if addr is not None:
        assert _refused(addr, store.port)  # from another address: nothing there
    replica = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10))
    replica.set("splitlearn/fed/gen", "1")  # loopback: the replicas' store, working
    assert store.get("splitlearn/fed/gen") == b"1" and replica.add("n", 2) == 2


def test_the_store_binds_ipv6_loopback_when_given_it():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        store = host_store("::1", 0)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    assert on_port(store.port) == [ip_address("::1")]


def test_python_m_splitlearn_cluster_store_listens_where_told():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitlearn.cluster.store", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not on_port(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the store did not start"
            time.sleep(0.1)
        assert on_port(port) == [LOOPBACK]  # its default --host
    finally:
        proc.terminate()
        assert proc.wait(30) == 0

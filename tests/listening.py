"""Which TCP sockets listen, and where: read from /proc/net/tcp and /proc/net/tcp6 (Linux).

``listening()`` lists ``(address, port, inode)`` of every listening socket; ``of_pids(pids)``
keeps those that the given processes hold (their /proc/<pid>/fd links ``socket:[inode]``);
``public_address()`` is this machine's non-loopback IPv4 address, if it has one.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import Iterable, Optional

import pytest

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def _address(hex_addr: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hex_addr)
    # the kernel prints each 32-bit word in host byte order (little-endian here)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return ipaddress.ip_address(raw)


def listening() -> list[tuple[ipaddress._BaseAddress, int, int]]:
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs Linux's /proc/net/tcp")
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != LISTEN:
                    continue
                addr, port = cols[1].split(":")
                out.append((_address(addr), int(port, 16), int(cols[9])))
    return out


def on_port(port: int) -> list[ipaddress._BaseAddress]:
    """The addresses a socket listens on at ``port``."""
    return [a for a, p, _ in listening() if p == port]


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def of_pids(pids: Iterable[int]) -> list[tuple[ipaddress._BaseAddress, int]]:
    """``(address, port)`` of every socket the processes ``pids`` listen on."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    return [(a, p) for a, p, i in listening() if i in inodes]


def public_address() -> Optional[str]:
    """This machine's non-loopback IPv4 address (the one a default route would use), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: no packet is sent
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if ipaddress.ip_address(addr).is_loopback else addr

"""Tenants: who a bearer token is, and the walls between data owners.

Every accepted token is a *tenant*. A client id (``alice``) is a name chosen by a client
*inside* its tenant: the server keys every piece of per-client state (step ledger, lease,
sequential turn, SplitFed membership, LoRA adapter, generation sessions) by the scoped key
``"<tenant>:<client_id>"`` (client ids never contain ``:``), so another tenant's ``alice``
is a different client, and an id of another tenant is indistinguishable from one that
does not exist. Nothing is first-come: no tenant can squat an id of another.

Token file (``--token-file``), one token per line; blank lines and ``#`` comments ignored::

    <token>                      a tenant named t-<first 12 hex of sha256(token)>
    <name> <token>               a named tenant (name: 1-64 of [A-Za-z0-9_.-])
    <name> <token> operator      ... that may also act on the whole server

``$SPLITLEARN_TOKEN`` holds bare tokens, comma-separated. With exactly one token, that
token is the operator (a one-owner server needs no ceremony). Operator actions are the
ones that affect every tenant: ``POST /v1/checkpoint`` (a full fsync'd write of everything).

Weak tokens (shorter than :data:`MIN_TOKEN_CHARS`, or one of the documentation's
examples) are refused unless the operator forces them (``--allow-weak-tokens``).

Checks are constant-time: the given token's SHA-256 is compared with every tenant's
digest by ``hmac.compare_digest``, all of them, whatever matched first.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Iterable, Optional

from ..errors import ConfigError
from ..api.protocol import parse_token_line as parse_line

MIN_TOKEN_CHARS = 16  # secrets.token_urlsafe(12) gives 16; we generate 32
# tokens that appear in docs, examples and tutorials: never accepted unless forced
EXAMPLE_TOKENS = frozenset({"change-me", "changeme", "secret", "token", "password", "test", "tok",
                            "dev", "admin", "splitlearn", "example", "your-token", "<token>"})
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SEP = ":"  # between tenant and client id in a scoped key; never in either


def digest_of(token: str) -> str:
    """What the server keeps of a token: its SHA-256, hex (sessions are bound to it)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str  # operator-given, or t-<12 hex of the digest>
    digest: str  # sha256 hex of the token; the token itself is not kept
    operator: bool = False  # may act on the whole server (POST /v1/checkpoint)

    def key(self, client_id: str) -> str:
        """The scoped key of ``client_id`` in this tenant: what server state is keyed by."""
        return f"{self.name}{SEP}{client_id}"


def client_of(key: str) -> str:
    """``client_id`` of a scoped key (what a tenant is shown of its own clients)."""
    return key.split(SEP, 1)[1] if SEP in key else key


def tenant_of(key: str) -> str:
    return key.split(SEP, 1)[0] if SEP in key else ""


def is_weak(token: str) -> bool:
    return len(token) < MIN_TOKEN_CHARS or token.lower() in EXAMPLE_TOKENS


class Tenants:
    """The accepted tokens as tenants; :meth:`authenticate` maps a header to one."""

    def __init__(self, entries: Iterable[str], allow_weak: bool = False):
        parsed = [p for p in (parse_line(e) for e in entries) if p is not None]
        if not parsed:
            raise ConfigError("no token: give --token-file or set SPLITLEARN_TOKEN")
        sole = len(parsed) == 1
        self._by_digest: list[tuple[bytes, Tenant]] = []
        names: set[str] = set()
        for name, token, operator in parsed:
            if is_weak(token) and not allow_weak:
                raise ConfigError(f"refusing a weak token ({len(token)} characters{', an example token' if token.lower() in EXAMPLE_TOKENS else ''}): "
                                  f"use at least {MIN_TOKEN_CHARS} random characters, e.g. "
                                  f"python -c 'import secrets; print(secrets.token_urlsafe(32))' "
                                  f"(or force it with --allow-weak-tokens)")
            d = digest_of(token)
            name = name or f"t-{d[:12]}"
            if not _NAME.fullmatch(name):
                raise ConfigError(f"tenant name {name!r} must be 1-64 characters of [A-Za-z0-9_.-]")
            if name in names:
                raise ConfigError(f"tenant {name!r} appears twice in the token file")
            if any(hmac.compare_digest(d.encode(), known) for known, _ in self._by_digest):
                raise ConfigError(f"tenant {name!r}: the same token is given twice")
            names.add(name)
            self._by_digest.append((d.encode(), Tenant(name, d, operator or sole)))

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def names(self) -> list[str]:
        return [t.name for _, t in self._by_digest]

    def authenticate(self, header: Optional[str]) -> Optional[Tenant]:
        """The tenant of an ``Authorization: Bearer <token>`` header value; None if none.

        Constant-time in the token: every tenant's digest is compared, whatever matched."""
        if not header or not header.startswith("Bearer "):
            return None
        given = digest_of(header[7:].strip()).encode()
        found = None
        for known, tenant in self._by_digest:
            if hmac.compare_digest(given, known):
                found = tenant
        return found

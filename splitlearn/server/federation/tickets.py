"""Signed statements from the segment server to the fed server, carried by clients.

- ``sync``: answered to a member's sync (``ticket``): mode, round, the version the member
  trained from, its tenant, client id and the rows the segment server counted for it;
- ``close``: ``last_close`` in ``GET /v1/federation`` once a round or turn closed: the round,
  the version it produced and the members that synced (forwarded by clients to
  ``POST /v1/federation/close``).

Format: ``base64url(JSON) + "." + hex(HMAC-SHA256(secret, b"splitlearn-fed/1\\n" + JSON))``, the
secret shared by the two servers only (``--fed-secret-file``). MACs are compared with
``hmac.compare_digest``; JSON is parsed only after the MAC matched. Design:
docs/FEDERATION.md, 'Who sees the client-side weights'.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import asdict, dataclass

from ...errors import BadRequest, Forbidden
from ...api.protocol import MAX_TICKET_CHARS

DOMAIN = b"splitlearn-fed/1\n"  # what the MAC covers starts with this: no other HMAC use collides


@dataclass(frozen=True)
class Ticket:
    """The segment server's word that a member synced: what its upload counts for."""

    mode: str  # sequential | splitfed
    round: int  # splitfed: the segment server's round; sequential: 0
    version: int  # version of the shared client-side weights the member trained from
    tenant: str  # the member's tenant name (the fed token must be this tenant's)
    client_id: str  # the member's client id within its tenant
    samples: int  # rows the segment server counted for it in the round (FedAvg weight)
    kind: str = "sync"


@dataclass(frozen=True)
class Close:
    """The segment server's word that a round (or turn) closed, producing ``version``."""

    mode: str
    round: int
    version: int  # the version of the shared weights after the round
    synced: int  # members whose weights belong in the average
    kind: str = "close"


def _mac(secret: bytes, body: bytes) -> str:
    return hmac.new(secret, DOMAIN + body, hashlib.sha256).hexdigest()


def sign(secret: bytes, statement) -> str:
    """``statement`` (a :class:`Ticket` or :class:`Close`) as a signed string."""
    body = json.dumps(asdict(statement), sort_keys=True, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(body).decode().rstrip("=") + "." + _mac(secret, body)


def verify(secret: bytes, signed: object, cls: type):
    """The :class:`Ticket` or :class:`Close` (``cls``) ``signed`` carries; 403 if the segment
    server did not sign it (or it was altered), 400 if it is not a statement at all."""
    if not isinstance(signed, str) or not 0 < len(signed) <= MAX_TICKET_CHARS or signed.count(".") != 1:
        raise BadRequest(f"a {cls.__name__.lower()} must be the string the segment server gave (base64.mac)")
    encoded, mac = signed.split(".")
    try:
        body = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except ValueError:
        raise BadRequest(f"the {cls.__name__.lower()} is not base64url") from None
    if not hmac.compare_digest(mac.encode(), _mac(secret, body).encode()):
        raise Forbidden(f"the {cls.__name__.lower()} was not signed by the segment server this fed server "
                        f"trusts (another --fed-secret-file?) or was altered")
    fields = json.loads(body)
    if fields.get("kind") != cls.kind:
        raise BadRequest(f"expected a {cls.kind} statement, got {fields.get('kind')!r}")
    return cls(**fields)

"""Generation sessions: one KV cache per session for the server's segment.

A session is opened by a token holder, addressed by an unguessable id
(``secrets.token_urlsafe``), and visible only to the token that opened it: any other token
gets 404, as for an id that never existed. Idle sessions expire after ``ttl_s``. Limits:
``max_sessions`` open sessions on the server (503 + Retry-After when full), at most
``max_per_owner`` of them for one tenant (429), and ``max_tokens`` cached tokens (rows x
length, summed over a tenant's sessions; 429 + Retry-After when exceeded), so no tenant
takes every slot or the whole cache. The owner is the tenant's token digest
(:mod:`.tenants`).
"""
from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import NotFound, ServiceUnavailable, TooManyRequests
from ..segments import SegmentCache


def owner_of(token: str) -> str:
    """Sessions are bound to a digest of the token, never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class Session:
    id: str
    owner: str
    rows: int  # batch size fixed at open
    cache: SegmentCache
    mask: Optional[torch.Tensor] = None  # (rows, length) 0/1 of the positions seen; None: no padding
    client_id: Optional[str] = None  # whose LoRA adapter the session uses (LoRA servers)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return self.rows * self.cache.length


class SessionStore:
    def __init__(self, new_cache, ttl_s: float, max_sessions: int, max_tokens: int,
                 max_per_owner: Optional[int] = None):
        self._new_cache = new_cache  # () -> SegmentCache for the server's segment
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.max_per_owner = max_per_owner or max_sessions  # one tenant's share of max_sessions
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def _expire(self, now: float) -> None:
        for sid in [s.id for s in self._sessions.values() if now - s.last_used > self.ttl_s]:
            del self._sessions[sid]

    def open(self, owner: str, rows: int) -> Session:
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            mine = [s.last_used for s in self._sessions.values() if s.owner == owner]
            if len(mine) >= self.max_per_owner:
                raise TooManyRequests(
                    f"this tenant holds {len(mine)} generation sessions, its limit "
                    f"(--max-sessions-per-tenant {self.max_per_owner}): close one",
                    retry_after=max(1.0, self.ttl_s - (now - min(mine))))
            if len(self._sessions) >= self.max_sessions:
                oldest = min(s.last_used for s in self._sessions.values())
                raise ServiceUnavailable(
                    f"the server holds its maximum of {self.max_sessions} generation sessions",
                    retry_after=max(1.0, self.ttl_s - (now - oldest)))
            sess = Session(secrets.token_urlsafe(18), owner, rows, self._new_cache())
            self._sessions[sess.id] = sess
            return sess

    def get(self, owner: str, sid: str) -> Session:
        with self._lock:
            self._expire(time.monotonic())
            sess = self._sessions.get(sid)
            if sess is None or not secrets.compare_digest(sess.owner, owner):
                raise NotFound(f"no generation session {sid!r} (unknown, expired or closed)")
            sess.last_used = time.monotonic()
            return sess

    def reserve(self, sess: Session, new_positions: int) -> None:
        """Refuse a step that would take the holder past ``max_tokens`` cached tokens."""
        with self._lock:
            held = sum(s.tokens for s in self._sessions.values() if s.owner == sess.owner)
            want = sess.rows * new_positions
            if held + want > self.max_tokens:
                raise TooManyRequests(
                    f"this token holds {held} cached tokens; {want} more would pass the limit of "
                    f"{self.max_tokens}: close sessions you no longer need",
                    retry_after=self.ttl_s)

    def close(self, owner: str, sid: str) -> None:
        sess = self.get(owner, sid)
        with self._lock:
            self._sessions.pop(sess.id, None)

    def count(self, owner: Optional[str] = None) -> int:
        with self._lock:
            return sum(1 for s in self._sessions.values() if owner is None or s.owner == owner)

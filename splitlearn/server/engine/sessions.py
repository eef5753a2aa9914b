"""Generation sessions: one KV cache per session for the server's segment.

A session is opened by a token holder, addressed by an unguessable id
(``secrets.token_urlsafe``), and visible only to the token that opened it: any other token
gets 404, as for an id that never existed. Idle sessions expire after ``ttl_s``. Limits:
``max_sessions`` open sessions on the server (503 + Retry-After when full), at most
``max_per_owner`` of them for one tenant (429), and ``max_tokens`` cached tokens (rows x
length, summed over a tenant's sessions; 429 + Retry-After when exceeded), so no tenant
takes every slot or the whole cache. The owner is the tenant's token digest
(:mod:`.tenants`).

Cache operations (``transformers``' ``generate()`` over a split model: beam search, several
sequences per prompt, assisted decoding). A step may carry, besides its new positions, two
operations applied to the session's cache *before* them, in this order::

    reorder  I64 (R,) tensor "reorder": rows of the cache to keep, in order (index_select on
             the batch dim of every block's keys and values, and of the kept mask). Beam search's
             reorder (R = rows), select (R < rows), repeat_interleave (R = k x rows); each index
             in [0, rows), 1 <= R <= max_batch. The session has R rows from then on.
    crop     metadata "crop" = N: keep the first N cached positions, 0 <= N <= length
             (assisted decoding drops the rejected draft); then "position" must be N. A sliding
             layer (its window's last positions only) goes back through its own crop, as in
             transformers' assisted decoding: it records a step's positions until the next step
             crops (every step does, 0 without the field: back to window - 1), so a crop may
             drop at most the last step's new positions there (N = 0 always); deeper is 400.

so beam search and speculative decoding cost one round trip per step, as plain decoding does.
A step that carries either must be numbered (metadata ``step``: 1, 2, 3... per session, counting
every step the session took), and a numbered step is applied exactly once: the same number
again (a transport retry after the answer was lost) gets the stored answer and changes
nothing; any other number but the next is 409. The session holds the answer of its last
numbered step until the next one. A refused step (400, 409, 413, 429) changes nothing: every
check runs before the cache is touched: the request's form on its thread (:func:`step_ops`),
its fit to the session on the compute thread right before the forward (:meth:`Session.begin`),
where the session's state is current. Cached-token accounting sees the rows and length after the
operations (``R x (N + T)``).
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...errors import BadRequest, Conflict, NotFound, ServiceUnavailable, TooManyRequests
from ...model.segments import SegmentCache, droppable, filled

REORDER = "reorder"  # the tensor name (splitlearn.api.protocol.REORDER)


@dataclass
class Session:
    id: str
    owner: str
    rows: int  # batch size: set at open, changed by a step's reorder
    cache: SegmentCache
    mask: Optional[torch.Tensor] = None  # (rows, length) 0/1 of the positions seen; None: no padding
    client_id: Optional[str] = None  # whose LoRA adapter the session uses (LoRA servers)
    last_used: float = field(default_factory=time.monotonic)
    step: int = 0  # steps taken (numbered or not); a numbered step must be step + 1
    answer: Any = None  # the last numbered step's answer (a retry gets it back); None: none, or running
    busy: bool = False  # a step has begun and not finished (its forward is running)
    tenant: str = ""  # whose memory its KV cache counts in (splitlearn/server/memory.py)
    hold: Any = field(default=None, repr=False)  # the memory account's Hold of its KV cache

    @property
    def tokens(self) -> int:
        return self.rows * self.cache.length

    def begin(self, step: Optional[int], position: int, ops: "CacheOps", new_positions: int,
              store: "SessionStore") -> None:
        """Check a step against the session as it is now and, if it may run, apply its cache
        operations and count it begun. Raises :class:`Replay` (a retry of the last numbered step:
        answer it with ``exc.answer``), 409, 400 or 429, changing nothing. On the compute thread,
        under the runtime's lock, right before the step's forward."""
        if step is not None and step == self.step and self.answer is not None:
            raise Replay(self.answer)
        if self.busy:
            raise Conflict(f"session {self.id!r}: step {self.step} is still running; send the next "
                           f"step when it is answered")
        if step is not None and step != self.step + 1:
            if step == self.step:
                raise Conflict(f"session {self.id!r}: step {step} failed on the server; open a new session")
            raise Conflict(f"session {self.id!r} has taken {self.step} steps; this is step {step} "
                           f"(expected {self.step + 1})")
        rows, length = ops.check(self)
        if position != length:
            raise Conflict(f"session {self.id!r} has seen {length} positions; this step starts at {position}")
        store.reserve(self, new_positions, rows=rows, past=length)
        ops.apply(self)  # nothing can fail from here on
        self.step += 1
        self.answer, self.busy = None, True

    def end(self, answer: Any, numbered: bool) -> None:
        """The step's forward is done (``answer``), or failed (None)."""
        self.busy = False
        self.answer = answer if numbered else None


class Replay(Exception):
    """A retry of the session's last numbered step: answer with the stored ``answer``."""

    def __init__(self, answer: Any):
        super().__init__("replayed")
        self.answer = answer


@dataclass(frozen=True)
class CacheOps:
    """A step's cache operations: ``index`` (R,) int64 rows to keep in order, ``crop`` N
    positions to keep (None: no such operation)."""

    index: Optional[torch.Tensor] = None
    crop: Optional[int] = None

    def __bool__(self) -> bool:
        return self.index is not None or self.crop is not None

    def check(self, sess: Session) -> tuple[int, int]:
        """Rows and length of ``sess``'s cache after the operations; 400 if they do not fit it."""
        rows, length = sess.rows, sess.cache.length
        if self.index is not None:
            check_index(self.index, rows)
            rows = int(self.index.numel())
        if self.crop is not None:
            if not 0 <= self.crop <= length:
                raise BadRequest(f"crop={self.crop}: the session holds {length} positions "
                                 f"(0 <= crop <= {length})")
            deepest = min((droppable(layer) for layer in filled(sess.cache.kv)), default=length)
            if self.crop and length - self.crop > deepest:
                raise BadRequest(f"crop={self.crop}: a sliding-window layer keeps only its window's last "
                                 f"positions and the last step's; this session can drop at most {deepest} "
                                 f"of its {length} (crop >= {length - deepest}, or 0)")
            length = self.crop
        return rows, length

    def apply(self, sess: Session) -> None:
        """Reorder the rows, then drop the positions past ``crop`` (checked by :meth:`check`).

        Every step crops, as transformers' assisted decoding does after each forward: each filled
        layer's own ``crop(-k)`` (``k = length - crop``, 0 without a crop): a full layer drops its
        last k positions, a sliding one (recording its past since the session opened,
        :meth:`SessionStore.open`) goes back k positions and keeps its window's last
        ``window - 1`` of them, so ``crop(0)`` bounds it again (:func:`droppable`)."""
        kv, length = sess.cache.kv, sess.cache.length
        if self.index is not None:
            if length > 0:
                kv.reorder_cache(self.index)  # index_select(0) of every filled layer's keys, values
            if sess.mask is not None:
                sess.mask = sess.mask.index_select(0, self.index)  # (R, length)
            sess.rows = int(self.index.numel())
        remove = length - self.crop if self.crop is not None and self.crop < length else 0
        for layer in filled(kv):
            layer.crop(-remove)  # (R, H, length - remove, hd); a sliding layer at most window - 1 of them
        if remove:
            if sess.mask is not None:
                sess.mask = sess.mask[:, :self.crop]
            sess.cache.length = self.crop


def check_index(index: torch.Tensor, rows: int, why: str = "the session has {rows} rows") -> None:
    """400 unless ``index`` indexes rows of a ``rows``-row cache."""
    if bool(((index < 0) | (index >= rows)).any()):
        raise BadRequest(f"tensor {REORDER!r} holds indices outside [0, {rows}): " + why.format(rows=rows))


def step_ops(tensors: dict, meta, sess: Session, max_rows: int) -> CacheOps:
    """The cache operations of a step request (``meta``: its :class:`~splitlearn.api.protocol.
    SessionStepMeta`); 400 for anything malformed. Runs on the request's thread, before anything
    is touched; whether they fit the session (indices below its rows, crop within its length) is
    checked by :meth:`Session.begin`, after a retry of an applied step has been answered."""
    index = tensors.get(REORDER)
    if index is not None:
        if index.dtype not in (torch.int64, torch.int32):
            raise BadRequest(f"tensor {REORDER!r} must be int64 row indices, got {index.dtype}")
        if index.ndim != 1 or not 1 <= index.numel() <= max_rows:
            raise BadRequest(f"tensor {REORDER!r} must have shape [R] with 1 <= R <= {max_rows} "
                             f"(the server's max_batch), got {list(index.shape)}")
        index = index.long()
        check_index(index, max_rows, "the server's max_batch is {rows}")  # against the session's rows in Session.begin (after a replay)
    if meta.crop is not None and meta.position != meta.crop:
        raise BadRequest(f"a step that crops to {meta.crop} positions starts there: position must be "
                         f"{meta.crop}, got {meta.position}")
    ops = CacheOps(index, meta.crop)
    if ops and meta.step is None:
        raise BadRequest("a step that reorders or crops the cache must be numbered (metadata 'step': "
                         "1, 2, 3... per session), so that a retry cannot apply it twice")
    return ops


class SessionStore:
    def __init__(self, new_cache, ttl_s: float, max_sessions: int, max_tokens: int,
                 max_per_owner: Optional[int] = None):
        self._new_cache = new_cache  # () -> SegmentCache for the server's segment
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.max_per_owner = max_per_owner or max_sessions  # one tenant's share of max_sessions
        self.account = None  # the server's MemoryAccount: each session's KV cache reserved in it
        self.kv_bytes = lambda tokens, rows, new: 0  # a KV cache of tokens in rows after new (budget.session_bytes)
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def _expire(self, now: float) -> None:
        for sid in [s.id for s in self._sessions.values() if now - s.last_used > self.ttl_s]:
            self._drop(self._sessions.pop(sid))

    def _drop(self, sess: Session) -> None:
        if self.account is not None:
            self.account.release(sess.hold)

    def open(self, owner: str, rows: int, tenant: str = "") -> Session:
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
            cache = self._new_cache()
            cache.activate_past_recording()  # sliding layers keep a step's past until the next step's crop
            sess = Session(secrets.token_urlsafe(18), owner, rows, cache, tenant=tenant)
            if self.account is not None:  # grown with its cache at every step (reserve)
                sess.hold = self.account.reserve(tenant, 0, "a generation session")
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

    def reserve(self, sess: Session, new_positions: int, rows: Optional[int] = None,
                past: Optional[int] = None) -> None:
        """Refuse a step that would take the holder past ``max_tokens`` cached tokens: ``sess``
        goes from its tokens now to ``rows x (past + new_positions)`` (rows and length after the
        step's cache operations; default: as they are)."""
        rows = sess.rows if rows is None else rows
        past = sess.cache.length if past is None else past
        with self._lock:
            held = sum(s.tokens for s in self._sessions.values() if s.owner == sess.owner)
            want = rows * (past + new_positions) - sess.tokens
            if held + want > self.max_tokens:
                raise TooManyRequests(
                    f"this token holds {held} cached tokens; {want} more would pass the limit of "
                    f"{self.max_tokens}: close sessions you no longer need",
                    retry_after=self.ttl_s)
            if sess.hold is not None:  # its cache after the step, reserved before it grows (429/503)
                sess.hold.resize(self.kv_bytes(rows * (past + new_positions), rows, new_positions))

    def close(self, owner: str, sid: str) -> None:
        sess = self.get(owner, sid)
        with self._lock:
            if self._sessions.pop(sess.id, None) is not None:
                self._drop(sess)

    def usage(self) -> dict[str, tuple[int, int]]:
        """``{tenant name: (open sessions, cached tokens)}`` (``/metrics``)."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for s in self._sessions.values():
                n, tokens = out.get(s.tenant, (0, 0))
                out[s.tenant] = (n + 1, tokens + s.tokens)
        return out

    def count(self, owner: Optional[str] = None) -> int:
        with self._lock:
            return sum(1 for s in self._sessions.values() if owner is None or s.owner == owner)


def step_budget(budget, rows: int, past: int, T: int, mask: Optional[torch.Tensor],
                logits: Optional[int], head: bool, grows: bool, max_tokens: int) -> None:
    """413 before anything is allocated, for a step of ``rows`` x ``T`` new positions after
    ``past`` (:mod:`.budget`): with ``logits`` positions' logits of a top (beyond the last one
    the step always prices), and, for a step whose reorder gives the session more rows than it
    had (``grows``), the KV cache it may grow to at that many rows (as at open)."""
    from .budget import padded, session_step_cost  # the pricing lives there

    if logits is not None and not head:
        raise BadRequest("metadata field 'logits' is for 2-way servers (a top); this one answers "
                         "the trunk's hidden states of every new position")
    if grows:
        budget.session(rows, max_tokens)
    need = session_step_cost(budget.dims, rows, past, T, padded(mask))
    k = T if logits == 0 else min(logits or 1, T)
    if head and k > 1:  # the k positions' logits, and packed
        need += int((k - 1) * rows * budget.dims.vocab * (budget.dims.elem + 4) * 1.25)
    budget.check(f"a generation step of {rows} x {T} positions after {past}"
                 + (f" answering {k} positions' logits" if k > 1 else ""), need)

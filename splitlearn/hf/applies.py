"""Where a step's deferred apply waits, and what sends it, so that no step is lost.

The apply of a training step (the client's ``optimizer.step()``, :meth:`Applier.apply`) rides
on the next step's first forward. When no next step comes soon, it is sent on its own:

==============================================  ===========================================
when                                            who sends it
==============================================  ===========================================
the process idles ``apply_wait_s`` (0.1 s)      :class:`IdleFlusher` (one daemon thread)
something needs the server to hold the step     ``flush()``: a sync, an evaluation, a
                                                generation, ``save_pretrained``,
                                                ``export_adapter``, a checkpoint, ``close()``
the interpreter exits                           the segment's finalizer (:func:`last_call`);
                                                every live segment's at once, in threads
                                                joined within :data:`LAST_CALL_S` (+1 s)
the model is garbage collected                  the same finalizer, with the segment gone:
                                                :meth:`Outbox.send_alone`, from a thread of
                                                its own (the collecting thread never waits;
                                                exit joins it)
==============================================  ===========================================

A step ends one way: :meth:`Applier.apply` defers the apply (or, when it cannot wait, sends
it), and whoever sends it (a carrying forward's answer, a flush, the idle flusher, the last call)
hands the answer to :meth:`Applier.answered`, the one place a deferred apply is settled. The
idle timer has one owner, the :class:`Applier`, which schedules it with the process's
:class:`IdleFlusher`.

The idle flusher is a daemon thread: it dies with the process, so before the finalizer a
script that simply ended after its last ``optimizer.step()`` left that step on the client alone
(issue 41: a 3-step loop moved the server twice). At exit the finalizer also drops the pieces of
a step the client never stepped (its forwards hold a shared segment's lease otherwise). Both
last calls are bounded (:data:`LAST_CALL_S`), never raise, and log a warning when the server
cannot be reached: the step is then the journal's to replay (docs/RECOVERY.md).
"""
from __future__ import annotations

import atexit
import heapq
import json
import logging
import threading
import time
import weakref
from dataclasses import replace
from typing import Optional

from ..api import protocol as P
from .journal import RequestLog, Sent

log = logging.getLogger(__name__)

LAST_CALL_S = 5.0  # seconds a last call may wait for an answer, or for a crashed server to come back
_UNREACHABLE: set = set()  # servers a last call at exit found gone: the other segments' do not wait for them
_LIVE: set = set()  # the finalizers of segments not yet collected (run at exit: _at_exit)
_SENDING: set = set()  # threads sending a collected segment's apply (joined at exit)


class Outbox:
    """A segment's deferred apply, and what sending it alone needs without the segment (the
    connection, the request log): its finalizer holds this, not the segment."""

    def __init__(self, transport, requests: RequestLog):
        self.lock = threading.RLock()  # a carrying forward, a flush and the idle flusher take it
        self.req: Optional[P.ApplyRequest] = None  # the last step's apply, not yet answered
        self.carrying = False  # a forward carries req (the idle flush leaves it)
        self.answered_step = 0  # the step of the last apply answered (set before req is cleared)
        self.transport, self.requests = transport, requests

    def send_alone(self) -> None:
        """The segment was garbage collected with ``req`` deferred: send it as one bounded
        request (:func:`bounded`) and log it in the journal as a flush would."""
        with self.lock:
            req, self.req = self.req, None
            if req is None:
                return
            bounded(self.transport)
            answer = self.transport.post_json(P.TRAIN_APPLY, req.to_json())
            self.requests.record(req.step, Sent(P.TRAIN_APPLY, None, req.to_json()), answer)
            log.info("step %d of client %s applied as its model was dropped", req.step, req.client_id)


class Applier:
    """How a segment's steps end: the apply of each, deferred to ride on the next step's first
    forward, or sent alone (:meth:`flush`); the answers it gets (:attr:`last`).

    ``segment``: the :class:`~splitlearn.hf.remote.RemoteSegment` (held weakly), whose step
    (``segment.steps``), clip (``segment.link``) and journal (``segment.journal``) an apply
    reads. ``idle_s``: how long a deferred apply waits for a forward before the idle flusher
    sends it (``RemoteConfig.apply_wait_s``, at most a third of the server's lease).
    """

    def __init__(self, segment, outbox: Outbox, idle_s: float):
        self._segment = weakref.proxy(segment)
        self._segment_ref = weakref.ref(segment)  # (the idle flusher holds it while it sends)
        self.outbox = outbox
        self.idle_s = idle_s
        self.carry = True  # False: every apply is a POST /v1/train/apply of its own
        self.last: Optional[dict] = None  # the server's answer to the last apply
        self.count = 0  # applies made
        self._lr_capped = False

    @property
    def deferred(self) -> Optional[P.ApplyRequest]:
        """The last step's apply, carried by the next step's first forwards (or sent alone)."""
        return self.outbox.req

    @property
    def segment(self):
        """The segment, if it is alive (None once collected)."""
        return self._segment_ref()

    def carried_by(self, step: int) -> Optional[str]:
        """A forward of ``step`` is being sent: the deferred apply of the step before as its
        metadata ``apply`` (the idle flusher then leaves it), or None."""
        with self.outbox.lock:
            d = self.outbox.req
            if d is None or d.step != step - 1:
                return None
            self.outbox.carrying = True
            return json.dumps(d.to_json(), separators=(",", ":"))

    def apply(self, lr: float) -> Optional[dict]:
        """The apply of the current step at ``lr``; the next pieces belong to the next step.
        Deferred (:attr:`carry`; returns None, the answer is :attr:`last` once it came), else
        ``POST /v1/train/apply`` now (returns the server's answer): when the server asked for it
        now (another client waits for the shared segment) or the journal answers the step."""
        seg = self._segment
        steps = seg.steps
        self.flush()
        req = P.ApplyRequest(seg.client_id, steps.step, steps.answered, float(lr), seg.link.clip_factor(), run=seg.run)
        self.count += 1
        now = not self.carry or steps.apply_now or seg.journal.answers(steps.step)
        # From here the step's apply is owed to the server: an interrupt at any later point (Ctrl-C,
        # or the request in flight when it came) leaves it in the outbox, which a flush (close(),
        # the last call) sends, and the step is never discarded (:meth:`made`); a retry of an apply
        # the server applied gets its stored answer. Sent now, it goes as a flush does, the step
        # moved on first, so a crash of the server meanwhile replays its pieces (issue 51).
        with self.outbox.lock:
            self.outbox.carrying = False
            self.outbox.req = req
        steps.next()
        if not now:
            if self.idle_s:
                IDLE.schedule(self, req, self.idle_s)
            return None
        return self.flush()

    def made(self, step: int) -> bool:
        """Was the apply of ``step`` made (owed to the server, or answered)? Such a step is
        complete: its pieces are the server's to apply, never to discard."""
        req = self.outbox.req
        return (req is not None and req.step == step) or self.outbox.answered_step == step

    def flush(self) -> Optional[dict]:
        """Send the deferred apply now (``POST /v1/train/apply``; a retry of one a forward
        already carried gets its stored answer): before whatever needs the server to hold the
        step (a sync, a checkpoint, an evaluation, a generation, ``close``). Returns its answer."""
        with self.outbox.lock:
            req = self.outbox.req
            if req is None:
                return None
            _, answer = self._segment.journal.call(req.step, Sent(P.TRAIN_APPLY, None, req.to_json()))
            self.answered(req, answer)
            return answer

    def idle_flush(self, req: P.ApplyRequest, segment=None) -> None:
        """The idle flusher's call: send ``req`` unless a forward carries it or it was answered
        (``segment``: the segment, held alive while its apply is sent; a collected one's apply
        is its finalizer's to send)."""
        with self.outbox.lock:
            if self.outbox.req is not req or self.outbox.carrying:
                return
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - the next forward carries it again, or raises
                log.warning("sending the deferred apply of step %d failed (%s); the next step's forward carries it",
                            req.step, e)

    def carried(self, step: int, info: dict) -> None:
        """A forward of ``step`` that carried the deferred apply was answered: its answer to the
        apply (metadata ``apply``) settles it, logged as if it had been sent alone."""
        req, carried = self.outbox.req, info.get("apply")
        if req is not None and carried is not None and req.step == step - 1:
            answer = json.loads(carried)
            self._segment.journal.logged(req.step, Sent(P.TRAIN_APPLY, None, req.to_json()), {}, answer)
            self.answered(req, answer)

    def answered(self, req: P.ApplyRequest, answer: dict) -> None:
        """The server's answer to ``req`` came (its own request's, or a carrying forward's)."""
        with self.outbox.lock:
            if self.outbox.req is req:
                self.outbox.answered_step = req.step  # (before req goes: made() sees one or the other)
                self.outbox.carrying = False
                self.outbox.req = None
        self.last = answer
        applied = answer.get("lr") if isinstance(answer, dict) else None
        if isinstance(applied, (int, float)) and applied < float(req.lr) and not self._lr_capped:
            self._lr_capped = True  # once: a schedule asks for it every step
            log.warning("the server applied lr %g, not this optimizer's %g: on weights shared between tenants it "
                        "steps at most at its own --lr (docs/SECURITY.md); start it with --lr >= your peak lr",
                        applied, float(req.lr))


def bounded(transport) -> None:
    """A connection whose requests wait at most :data:`LAST_CALL_S`, without retries (a last call)."""
    c = transport.cfg
    transport.cfg = replace(c, connect_timeout_s=min(c.connect_timeout_s, LAST_CALL_S),
                            read_timeout_s=min(c.read_timeout_s, LAST_CALL_S), retries=0)


def register(segment, outbox: Outbox) -> weakref.finalize:
    """The segment's finalizer (:func:`last_call`): run when it is collected, and at exit by
    :func:`_at_exit` with every other live segment's, in parallel. ``detach()`` drops it."""
    fin = weakref.finalize(segment, last_call, weakref.ref(segment), outbox)
    fin.atexit = False  # _at_exit runs it, beside the others, not one after another
    if len(_LIVE) > 64:
        _LIVE.difference_update([f for f in list(_LIVE) if not f.alive])
    _LIVE.add(fin)
    return fin


@atexit.register
def _at_exit() -> None:
    """Every live segment's last call at once (a process with segments of several servers, some
    gone, waits :data:`LAST_CALL_S` once, not once per server), and the applies of collected
    segments still being sent; all joined within ``LAST_CALL_S + 1`` seconds."""
    threads = [threading.Thread(target=f, name="splitlearn-last-call", daemon=True)
               for f in list(_LIVE) if f.alive]
    for t in threads:
        t.start()
    deadline = time.monotonic() + LAST_CALL_S + 1.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    wait_dropped(max(0.0, deadline - time.monotonic()))


def wait_dropped(timeout_s: float = LAST_CALL_S + 1.0) -> None:
    """Wait up to ``timeout_s`` for the applies of collected segments still being sent (exit
    does; so may a process about to end without exit handlers, ``os._exit``)."""
    deadline = time.monotonic() + timeout_s
    for t in list(_SENDING):
        t.join(max(0.0, deadline - time.monotonic()))


def _send_alone(outbox: Outbox) -> None:
    from ..errors import SplitLearnError

    try:
        outbox.send_alone()
    except (SplitLearnError, OSError) as e:
        log.warning("the apply of a dropped model could not be sent to %s (%s): the server does not hold it "
                    "(with a journal_dir, resume() replays it)", outbox.transport.cfg.url, getattr(e, "message", e))
    except Exception as e:  # noqa: BLE001 - a daemon thread's last words, never a traceback
        log.warning("the apply of a dropped model failed: %r", e)
    finally:
        _SENDING.discard(threading.current_thread())


def last_call(segment_ref, outbox: Outbox) -> None:
    """The segment's finalizer: at interpreter exit (the segment alive) its
    :meth:`~splitlearn.hf.remote.RemoteSegment.settle`; after it was garbage collected, its
    deferred apply alone. Bounded; a failure is a warning, never an exception at exit."""
    from ..errors import SplitLearnError, TransportError

    segment = segment_ref()  # alive: the interpreter is exiting
    server = outbox.transport.cfg.url
    if segment is not None and server in _UNREACHABLE:
        if outbox.req is not None:
            log.warning("the apply of step %d was not sent: %s did not answer a moment ago", outbox.req.step, server)
        return
    if segment is None:  # collected: sent from a thread of its own, whatever thread collected it
        if outbox.req is not None:
            t = threading.Thread(target=_send_alone, args=(outbox,), name="splitlearn-dropped-apply", daemon=True)
            _SENDING.add(t)
            t.start()
        return
    try:
        segment.settle()
    except (SplitLearnError, OSError) as e:
        if isinstance(e, (TransportError, OSError)):
            _UNREACHABLE.add(server)
        log.warning("the last step's apply could not be sent to %s before the end (%s): the server does not "
                    "hold it (with a journal_dir, resume() replays it)", server, getattr(e, "message", e))
    except Exception as e:  # noqa: BLE001 - never a traceback at exit, whatever went wrong
        log.warning("the last call to %s failed: %r", server, e)


class IdleFlusher:
    """Sends a deferred apply that waited ``idle_s`` for the next step's forward to carry it.

    A shared segment's lease is held from a step's first piece to its apply; a server drops a
    step whose lease expired (``--lease-timeout``) while another client waited. A client that
    idles between steps (a notebook, a slow data loader) would lose its step that way, so a
    deferred apply is sent on its own after ``RemoteConfig.apply_wait_s`` (0.1 s; at most a third
    of the lease timeout), so another owner waiting for the segment is not held up by an idle
    one. One daemon thread for the process keeps the times; it holds the appliers weakly, and
    sends each apply from a thread of its own: a flush that waits out a dead server's
    reconnect window must not hold up another segment's (whose lease would lapse meanwhile).
    """

    def __init__(self):
        self._due: list = []  # heap of (time due, sequence number, weakref to the segment, the apply)
        self._seq = 0
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def schedule(self, applier: Applier, req, idle_s: float) -> None:
        with self._cond:
            self._seq += 1
            heapq.heappush(self._due, (time.monotonic() + idle_s, self._seq, weakref.ref(applier), req))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="splitlearn-idle-apply", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._cond.wait(None if not self._due else self._due[0][0] - time.monotonic())
                _, _, ref, req = heapq.heappop(self._due)
            applier = ref()
            segment = applier.segment if applier is not None else None
            if segment is not None and applier.deferred is req:  # (not carried meanwhile: no thread)
                threading.Thread(target=applier.idle_flush, args=(req, segment), name="splitlearn-idle-apply-send",
                                 daemon=True).start()
            del applier, segment  # (this thread holds neither while it waits)


IDLE = IdleFlusher()

"""A segment's training requests sent, logged, and replayed after a crash of either side.

Every training request goes through :meth:`Recovery.call`: sent (a segment busy with another
client's step is waited out), logged in the :class:`~splitlearn.hf.journal.RequestLog` with the
digest of its answer, and, when the server crashed and restarted from its checkpoint behind
this client (a dropped connection past the transport's retries, or a 409 from a server that lost
steps), sent again after the requests the server lost are replayed (each answer checked against
the first). A retry (a dropped connection) repeats the same numbers and gets the stored answer.

With ``journal_dir`` the log is on disk with the client's checkpoint (:meth:`Recovery.persist`:
the model's state dict, the optimizer's and the RNG state), so a client killed at any point is
put back by :meth:`Recovery.resume` (``model.resume``) or ``SplitClient.load``
(:meth:`Recovery.restore` + :meth:`Recovery.load_journal`): the server brought to the
checkpoint's step, the logged steps after it answered from the log when they run again.
docs/RECOVERY.md tells the whole story.
"""
from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path
from typing import Optional

import torch

from ..api import protocol as P
from ..errors import ConfigError, Conflict, NotYourTurn, StaleWeights, TransportError
from .journal import LOCAL, RequestLog, Sent, digest, read_log

log = logging.getLogger(__name__)


class Recovery:
    """The segment's request log and what it makes possible: sending exactly once across crashes.

    ``segment``: the :class:`~splitlearn.hf.remote.RemoteSegment` (held weakly; its connection,
    config, ``client_id`` and step). ``requests``: its :class:`RequestLog`.
    """

    def __init__(self, segment, requests: RequestLog):
        self._segment = weakref.proxy(segment)
        self.log = requests
        self.snapshot_step = 0  # the step of the client checkpoint in cfg.journal_dir
        self._redo: dict[int, list] = {}  # resume(): step -> its journal records, answered from there

    @property
    def on_disk(self) -> bool:
        """The log is kept on disk (a ``journal_dir``, on a server that checkpoints)."""
        return self.log.directory is not None and self.log.enabled

    def answers(self, step: int) -> bool:
        """``step`` is one the server applied before a resume: the log answers its requests."""
        return step in self._redo

    @property
    def recoveries(self) -> list[dict]:
        """One entry per recovery from a server restart: ``{"server_step", "replayed"}``."""
        return self.log.replays

    # -- sending ---------------------------------------------------------------------------

    def send_once(self, sent: Sent, lane: int = 0) -> tuple[dict, dict]:
        """One request (waiting out a segment busy with another client's step) -> (tensors, info);
        a tensor request on transport ``lane``."""
        from ..transport.busy import wait_while_busy

        seg = self._segment
        if sent.tensors is None:  # an apply: JSON both ways
            return {}, seg.transport.post_json(sent.path, sent.meta)
        return wait_while_busy(lambda: seg.transport.call_meta(sent.path, sent.tensors, sent.meta, lane),
                               "the segment", seg.cfg.wait_timeout_s)

    def call(self, step: int, sent: Sent, lane: int = 0) -> tuple[dict, dict]:
        """Send one training request (on transport ``lane``: a piece's own); log it for a
        replay; if the server crashed and restarted behind this client, wait for it, replay what
        it lost, and send it again."""
        if step in self._redo:  # resume(): a step the server has applied, answered from the journal
            return self._redone(step, sent)
        cfg, transport = self._segment.cfg, self._segment.transport
        deadline = time.monotonic() + cfg.reconnect_timeout_s
        conflicts = 0
        while True:
            try:
                out, info = self.send_once(sent, lane)
                break
            except TransportError as e:
                if not self.log.enabled:
                    raise
                log.warning("server unreachable (%s); waiting up to %gs", e.message, cfg.reconnect_timeout_s)
                transport.wait_until_up(deadline, cfg.reconnect_timeout_s)
            except (StaleWeights, NotYourTurn):
                raise  # not a restart: the federation's answer, for the caller
            except Conflict:
                conflicts += 1
                if not self.log.enabled or conflicts > 1:
                    raise
            try:
                self.catch_up(lane)
            except TransportError:
                if time.monotonic() > deadline:
                    raise
        self.logged(step, sent, out, info)
        return out, info

    def logged(self, step: int, sent: Sent, out: dict, info: dict) -> None:
        """Log ``sent`` of ``step`` with its answer (a forward that carried the last step's apply
        settles that apply first, logged as if sent alone)."""
        if "apply" in sent.meta and sent.tensors is not None:
            self._segment.applier.carried(step, info)
            sent = Sent(sent.path, sent.tensors, {k: v for k, v in sent.meta.items() if k != "apply"})
        if sent.tensors is not None and self.log.enabled:
            sent.answer = digest(out)
        self.log.record(step, sent, out if sent.tensors is not None else info, info if sent.tensors is not None else None)
        if "durable" in info:
            self.log.durable(int(info["durable"]))

    # -- a crash of the server ---------------------------------------------------------------

    def catch_up(self, lane: int = 0) -> None:
        """Bring a restarted server back to this client's step: replay the logged requests of the
        steps it lost and of the step in progress (a server that lost nothing answers them from
        its ledger), one after another on transport ``lane`` (the caller's: pieces in flight hold
        the others)."""
        seg = self._segment
        state = seg.transport.get_json(P.CLIENT_STATE.format(client_id=seg.client_id))
        server = int(state["step"])
        if server >= seg.steps.step:  # it applied the step in progress: the apply's retry gets its answer
            return
        self.log.durable(min(int(state.get("durable", 0)), server))
        self.log.replay(server, seg.steps.step, lambda r: self.send_once(r, lane)[0])

    def current(self) -> None:
        """Before a read of this client's state on the server (an evaluation, a generation, the
        adapter or an export, a sync): a server behind the last step this client applied (one
        restarted from its checkpoint, or a replica that took this owner back and loaded its last
        durable state: docs/CLUSTER.md) first gets the steps it lost from the log, as a training
        request would at the next step; without this the read saw the weights of that durable
        step. One ``GET /v1/clients/<id>``, only while the log holds an applied step past the
        server's durable one (a server restarted from that state lacks nothing else). A server
        that does not answer is left to the read itself (which meets it as before)."""
        seg = self._segment
        if not self.log.enabled or not any(self.log.durable_step < s < seg.steps.step for s in self.log.steps):
            return
        try:
            state = seg.transport.get_json(P.CLIENT_STATE.format(client_id=seg.client_id))
        except TransportError as e:
            log.warning("could not ask %s which step of this client it holds before a read: %s",
                        seg.cfg.server, e.message)
            return
        if int(state["step"]) < seg.steps.step - 1:
            self.catch_up()

    def recover(self) -> int:
        """Bring a server that restarted from its checkpoint back to this client's step (training
        does it by itself) -> the number of steps replayed."""
        before = len(self.log.replays)
        self.catch_up()
        return sum(r["steps"] for r in self.log.replays[before:])

    # -- a crash of the client: the checkpoint and the log on disk (cfg.journal_dir) ----------

    def _is_journal(self, directory) -> bool:
        return self.log.directory is not None and Path(directory).resolve() == self.log.directory.resolve()

    def _owner(self):
        seg = self._segment
        owner = seg.link.owner
        return owner if owner is not None else seg

    def persist(self, optimizer: torch.optim.Optimizer, directory=None) -> None:
        """Write the model's weights, ``optimizer``'s state and the RNG state as the client
        checkpoint in ``directory`` (default: ``cfg.journal_dir``; between steps); drop the log
        the server's durable step and this checkpoint both hold."""
        from ..model.checkpoint import save_state

        seg = self._segment
        seg.applier.flush()  # the step this checkpoint holds is on the server (and in the log) first
        directory = Path(directory) if directory is not None else self.log.directory
        weights = {k: v.detach().cpu().clone() for k, v in self._owner().state_dict().items()}
        step = seg.steps.step - 1
        save_state(directory, "client", [], optimizer,
                   {"client_id": seg.client_id, "step": step, "cuts": list(seg.cuts)},
                   extra={"model": weights, "rng": {"cpu": torch.get_rng_state()}})
        if self._is_journal(directory):
            self.snapshot_step = step
        RequestLog(True, directory).prune(min(self.log.durable_step, step))

    def after_apply(self, optimizer: torch.optim.Optimizer) -> None:
        """After a step's apply: a new client checkpoint once the server's moved past the last."""
        if self.on_disk and self.log.durable_step > self.snapshot_step:
            self.persist(optimizer)

    def restore(self, directory, optimizer: torch.optim.Optimizer, rng: bool = True,
                client_id: Optional[str] = None) -> dict:
        """Load the client checkpoint in ``directory`` (:meth:`persist`'s) into the model and
        ``optimizer`` (and the RNG state if ``rng``) -> its counters (``client_id``, ``step``,
        ``cuts``). ConfigError if there is none, or it is not at the server's cuts (or not
        ``client_id``'s, if given)."""
        from ..model.checkpoint import has_state, load_state, read_extra

        seg = self._segment
        if directory is None or not has_state(directory, "client"):
            raise ConfigError(f"no client checkpoint in {directory}")
        counters = load_state(directory, "client", [], optimizer)
        if tuple(counters["cuts"]) != seg.cuts:
            raise ConfigError(f"checkpoint was made with cuts {counters['cuts']}, server has {list(seg.cuts)}")
        if client_id is not None and counters["client_id"] != client_id:
            raise ConfigError(f"the checkpoint in {directory} is client {counters['client_id']!r}'s, not {client_id!r}")
        weights = read_extra(directory, "client", "model")
        with torch.no_grad():
            for k, v in self._owner().state_dict(keep_vars=True).items():
                v.copy_(weights[k])
        if rng:
            torch.set_rng_state(read_extra(directory, "client", "rng")["cpu"])
        if self._is_journal(directory):
            self.snapshot_step = int(counters["step"])
        return counters

    def resume(self, optimizer: torch.optim.Optimizer) -> int:
        """After a crash of the client: :meth:`restore` the client checkpoint of
        ``cfg.journal_dir``, then :meth:`load_journal`. Returns the step the loop starts again at
        (its data must be that step's)."""
        seg = self._segment
        self.restore(self.log.directory, optimizer, client_id=seg.client_id)
        seg.link.attach(optimizer)
        self.load_journal(self.log.directory, self.snapshot_step)
        return seg.steps.step

    def load_journal(self, directory, mine: int) -> dict[int, dict]:
        """This client is back at step ``mine`` (its checkpoint): the logged steps in
        ``directory`` up to ``mine`` are kept for a replay, and sent again now if the server lost
        them; those after ``mine`` that the server has applied are answered from the log when
        they run again (no request; each request must equal the logged one); those it lost are
        forgotten (they run again for real). ``Conflict`` if the server and the journal do not
        meet. Returns the notes (:meth:`RequestLog.note`) of the steps after ``mine``."""
        seg = self._segment
        by_step: dict[int, list] = {}
        notes = {}
        for r in read_log(directory):
            if r.sent.path == LOCAL:
                notes[r.step] = r.sent.tensors
            else:
                by_step.setdefault(r.step, []).append(r)
        state = seg.transport.get_json(P.CLIENT_STATE.format(client_id=seg.client_id))
        server = int(state["step"])
        last = max([mine, *by_step, *notes])
        if server > last + 1 or any(s not in by_step for s in range(server + 1, mine + 1)):
            raise Conflict(f"client checkpoint is at step {mine} (journal to step {last}) but the server has "
                           f"applied step {server} for client {seg.client_id!r}: resume both sides from "
                           f"checkpoints of the same step")
        self.log.steps.clear()
        self.log.durable_step = 0
        self.log.durable(min(int(state.get("durable", server)), server))
        self._redo.clear()
        for step in sorted(by_step):
            if step <= mine:
                for r in by_step[step]:
                    self.log.remember(step, r.sent)
            elif step <= server:
                self._redo[step] = by_step[step]
            else:  # the server does not have it: it runs again for real
                self.log.drop(step)
        seg.steps.step = mine + 1
        seg.steps.reset()
        if server < mine:
            self.catch_up()
        return {s: t for s, t in notes.items() if s > mine}

    def _redone(self, step: int, sent: Sent) -> tuple[dict, dict]:
        """The logged answer to ``sent`` of a step the server has applied (see :meth:`resume`)."""
        queue = self._redo[step]
        if sent.tensors is None:  # the apply: the server has it
            del self._redo[step]
            rec = next((r for r in queue if r.sent.tensors is None), None)
            if rec is not None:
                self.log.remember(step, rec.sent)
            return {}, rec.answer if rec is not None else {"applied": True, "step": step}
        micro = sent.meta.get("micro", "0")
        rec = next((r for r in queue if r.sent.path == sent.path and r.sent.meta.get("micro", "0") == micro), None)
        if rec is None:  # its answer never reached the log (the client died waiting for it): the
            del self._redo[step]  # server's ledger answers the retry of its last step
            return self.call(step, sent)
        same = set(rec.sent.tensors) == set(sent.tensors) and all(
            torch.equal(rec.sent.tensors[k].cpu(), sent.tensors[k].detach().cpu()) for k in sent.tensors)
        if not same:
            raise Conflict(f"step {step} run again after a resume differs from the one the journal holds "
                           f"({sent.path}, piece {micro}): run the same data in the same order")
        queue.remove(rec)
        self.log.remember(step, rec.sent)
        return rec.answer, dict(rec.info or {})

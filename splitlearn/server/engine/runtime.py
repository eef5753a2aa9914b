"""The server's segment and everything that changes it: training steps, sessions, checkpoints.

One :class:`SegmentRuntime` per process holds one copy of the segment. It loads the segment
on its :class:`~.compute.ComputeThread`, and every method that touches tensors must be called
on that thread (why one thread: see :mod:`.compute`); the app's routes get there through
one decorator (``tensor_route``, :mod:`splitlearn.server.http.routing`). A lock guards the state that other threads read.

Methods take validated tensors and return an :class:`~.ledger.Answer` (tensors + string
metadata); the route layer decodes requests and encodes answers. Exactly-once training
steps are the :class:`~.ledger.StepLedger`'s business: a retry gets the stored answer back
without touching the weights, a step other than the next gets 409.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Optional

import torch

from ...api import protocol as P
from ...api.fingerprint import weight_parts
from ...model.checkpoint import has_state, load_state, make_optimizer, read_extra, save_state
from ...model.devices import dtype_name, resolve_device, resolve_dtype
from ...errors import BadRequest
from ...model.export import load_segment, read_segment_spec
from ...model.headloss import head_loss
from ...model.loading import load_model
from ...model.packed import PackedLinears
from .graphs import DecodeGraphs
from ...model.partition import partition
from ...model.segments import Segment
from ...api.wire import WIRE_DTYPE_NAMES, pack
from .batching import DecodeBatcher, DecodeItem
from .priority import DecodeBudget, Preemptor, QueueWaits
from .budget import make_budget, session_bytes
from .memory import TOTAL_FLAG, MemoryAccount, default_limits
from .compute import ComputeThread
from ..config import ServerConfig
from ...model.lora import lora_scope
from .adapters import attach as attach_lora
from .clientstate import ClientStates
from ..federation.modes import Federation, Replica, federation_options
from .gradclip import NormClip
from .lease import StepLease
from .ledger import Answer, StepLedger
from .training import Training, release as release_step
from .sessions import CacheOps, Replay, Session, SessionStore

log = logging.getLogger(__name__)


def build_segment(cfg: ServerConfig) -> tuple[Segment, tuple[int, ...]]:
    """The segment this server holds: the top (one cut) or trunk (two cuts), nothing else."""
    dev, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    if cfg.segment is not None:
        spec, _ = read_segment_spec(cfg.segment)
        return load_segment(cfg.segment, device=dev, dtype=dtype), tuple(spec["cuts"])
    model = load_model(cfg.model, dtype=dtype, device=dev, seed=cfg.seed)
    parts = partition(model, cfg.cuts)
    # The other segments' modules die with `model` and `parts`; only ours stays referenced.
    return (parts.trunk if parts.u_shape else parts.top), parts.cuts


def _extend_mask(past: Optional[torch.Tensor], new: Optional[torch.Tensor], rows: int,
                 past_len: int, new_len: int) -> Optional[torch.Tensor]:
    """The mask of the whole sequence so far, (rows, past_len + new_len); None if no padding yet."""
    if past is None and new is None:
        return None
    if past is None:
        past = torch.ones(rows, past_len, dtype=torch.long)
    if new is None:
        new = torch.ones(rows, new_len, dtype=torch.long)
    return torch.cat([past, new.long()], dim=1)


def _answered(future: Future, sess: Session, began: list) -> Future:
    """The answer of a queued decode step: a retry of the session's last numbered step
    (:class:`~.sessions.Replay`) gets the stored answer; a step whose forward failed after it
    began (``began``) leaves the session not busy (a retry of its number is refused: 409)."""
    out: Future = Future()

    def done(f: Future) -> None:
        err = f.exception()
        if err is None:
            out.set_result(f.result())
        elif isinstance(err, Replay):
            out.set_result(err.answer)
        else:
            if began:  # this step began, then its forward failed
                sess.end(None, numbered=False)
            out.set_exception(err)

    future.add_done_callback(done)
    return out


class SegmentRuntime:
    def __init__(self, cfg: ServerConfig, compute: Optional[ComputeThread] = None):
        self.cfg = cfg
        self.draining = False  # SIGTERM with --drain-seconds: /v1/ready answers 503 until the process stops
        self.compute = compute or ComputeThread(cfg.torch_threads)
        self.compute.run(self._load)

    def _load(self) -> None:
        cfg = self.cfg
        self.segment, self.cuts = build_segment(cfg)
        self.config = self.segment.config
        # the weights at load, before a checkpoint's: what a client compares at session start (/v1/info)
        self.fingerprint = weight_parts(self.segment.hf_state_dict())
        self.device = next(self.segment.parameters()).device
        self.dtype = next(self.segment.parameters()).dtype
        self.optimizer = self.make_optimizer(self.segment.parameters())
        # the bound of a step on state shared between tenants (gradclip.py): with one tenant, none but --max-grad-norm
        self.grad_clip = NormClip(cfg.grad_clip_factor if len(cfg.tenants) > 1 else None, cfg.grad_clip_window,
                                  cfg.grad_clip_warmup, cfg.max_grad_norm)
        self.lock = threading.RLock()
        self.ledger = StepLedger()
        self.training = Training(self)
        self.lease = StepLease(cfg.lease_timeout_s, on_expire=lambda cid: self.drop_pending(cid, release=False))
        self.federation = Federation(cfg.federation, Replica(self.segment, self.optimizer),
                                     self.make_optimizer, cfg.clients_per_round, cfg.round_timeout_s,
                                     **federation_options(cfg, self.config, self.cuts))
        self.federation.on_change = self.checkpoint  # a sync or a closed round is made durable
        self.sessions = SessionStore(self.segment.new_cache, cfg.session_ttl_s, cfg.max_sessions,
                                     cfg.max_tokens_per_client, cfg.max_sessions_per_tenant)
        self.waits = QueueWaits()  # per priority class (splitlearn/server/priority.py)
        self.batcher = DecodeBatcher(self.segment, self.compute, self.lock, batching=cfg.batching,
                                    wait_s=cfg.batch_wait_ms / 1e3, inference=self.inference,
                                    on_wait=lambda s: self.waits.record("decode", s), max_rows=cfg.decode_rows,
                                    budget=DecodeBudget(cfg.decode_share) if cfg.priority == "decode-first" else None)
        self.adapters = attach_lora(self) if cfg.lora is not None else None  # per-client LoRA
        self.states: Optional[ClientStates] = None  # replicas: per-client state in a shared dir
        if cfg.state_dir is not None:
            self.states = ClientStates(cfg.state_dir, self)
            self.adapters.on_lookup = self.states.claim  # a session's adapter: the newest one
        self.preemptor: Optional[Preemptor] = None
        if cfg.priority == "decode-first":  # training yields to queued decode steps
            self.preemptor = Preemptor(self.batcher.pending, self.batcher.run_now, self.compute.on_thread,
                                       self.batcher.budget)
        # generation's linear layers on prepacked weights (packed on their first product). With
        # several tenants every decode product is on the packed weight: a row's answer does not
        # depend on the other owners' rows batched with it (addmm's would), whatever is faster for
        # one row. With one tenant there is no other owner: each product takes what measured
        # fastest, as a client's do (on an Intel host the trunk's one-row step is ~15% faster)
        self._packed = (PackedLinears(self.segment, adaptive=len(cfg.tenants) == 1) if cfg.packed_weights
                        else None)
        # what one request may cost (413 beyond), priced on the segment as trained (LoRA: frozen base)
        self.budget = make_budget(self.segment, self.dtype, self.device, cfg.max_request_memory_bytes,
                                  cfg.optimizer, self._packed is not None)
        # what the server holds for its tenants beside that, per tenant and in total (memory.py)
        total, per_tenant = default_limits(self.budget.limit, len(cfg.tenants),
                                           cfg.max_memory_bytes or self.budget.total, cfg.max_tenant_memory_bytes)
        self.memory = MemoryAccount(total, per_tenant, TOTAL_FLAG if cfg.max_memory_bytes else
                                    self.budget.account_source())
        self.ledger.account = self.memory
        # the graphs capture the shared-rows decode, GPT-2's layout (docs/MODELS.md): other families none
        if (cfg.decode_graphs and self.device.type == "cuda" and self.adapters is None
                and self.segment.arch.family.decode_batching):
            self.batcher.graphs = DecodeGraphs(self.segment, cfg.decode_graphs, self.memory)
        self.sessions.account = self.memory
        self.sessions.kv_bytes = lambda n, rows, new: session_bytes(self.budget.dims, n, rows, new)
        if cfg.checkpoint_dir and has_state(cfg.checkpoint_dir, "server"):
            counters = load_state(cfg.checkpoint_dir, "server", [self.segment], self.optimizer)
            self.ledger = StepLedger.from_counters(counters)
            self.grad_clip.restore(counters.get("grad_clip", {}))
            self.ledger.account = self.memory
            self.ledger.hold_all()
            self.federation.restore(counters.get("federation", {}),
                                    read_extra(cfg.checkpoint_dir, "server", "federation"))
            log.info("resumed from %s: %d steps applied", cfg.checkpoint_dir, self.steps_applied)
        if cfg.fed_store is not None:  # SplitFed rounds over replicas (splitlearn/server/federation/collective.py)
            from ..config import GroupSpec
            self.federation.join_group(GroupSpec(cfg.fed_store, cfg.fed_rank, cfg.fed_world_size,
                                                 cfg.fed_timeout_s), self.compute.run)

    def inference(self):
        """Context of a generation step's forward: the segment's linear layers on prepacked
        oneDNN weights (``--no-packed-weights``: as they are); see :mod:`splitlearn.model.packed`."""
        return self._packed.active() if self._packed is not None else nullcontext()

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        c = self.cfg
        return make_optimizer(params, c.optimizer, c.lr, c.weight_decay)

    @property
    def steps_applied(self) -> int:
        return self.ledger.steps_applied

    # -- description -------------------------------------------------------------------

    @property
    def u_shape(self) -> bool:
        return self.segment.kind == "trunk"

    def info(self) -> dict:
        c = self.cfg
        return {
            "protocol_version": P.PROTOCOL_VERSION,
            "model_config": self.config.to_dict(),
            "fingerprint": {"dtype": dtype_name(self.dtype), "parts": self.fingerprint},
            "cuts": list(self.cuts),
            "segment": {"kind": self.segment.kind, "blocks": list(self.segment.blocks)},
            "shape": "u" if self.u_shape else "2-way",
            "labels_leave_client": not self.u_shape,
            "compute_dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "wire_dtypes": list(WIRE_DTYPE_NAMES),
            "optimizer": {"name": c.optimizer, "lr": c.lr, "weight_decay": c.weight_decay},
            "checkpoint": {"enabled": bool(c.checkpoint_dir or c.state_dir), "every": c.checkpoint_every,
                           "per_client": c.state_dir is not None},
            "steps_applied": self.steps_applied,
            "federation": c.federation,
            "limits": {"max_body_bytes": c.max_body_bytes, "max_echo_bytes": c.max_echo_bytes,
                       **c.door_limits().as_info(), "max_batch": c.max_batch,
                       "max_position_embeddings": self.config.max_position_embeddings,  # every family's name
                       "max_sessions": c.max_sessions,
                       "max_tokens_per_client": c.max_tokens_per_client,
                       "max_sessions_per_tenant": c.max_sessions_per_tenant,
                       "max_clients_per_tenant": c.max_clients_per_tenant,
                       "max_pending_per_tenant": c.max_pending_per_tenant,
                       "lease_timeout_s": c.lease_timeout_s, "session_ttl_s": c.session_ttl_s,
                       **self.budget.to_dict()},
            "priority": {"policy": c.priority, "waits": self.waits.summary(),
                         "preemptions": self.preemptor.preemptions if self.preemptor else 0,
                         "held_back": self.batcher.budget.held_back if self.batcher.budget else 0,
                         "decode_rows": c.decode_rows, "decode_share": c.decode_share},
            "generation": {"batching": c.batching, "batch_wait_ms": c.batch_wait_ms,
                           "packed_weights": c.packed_weights, "sessions": len(self.sessions),
                           "decode_steps": self.batcher.items, "decode_forwards": self.batcher.batches,
                           "decode_graphs": {"max_batch_sizes": c.decode_graphs,
                                             "captured": sorted(g.graphs) if (g := self.batcher.graphs) else [],
                                             "replays": g.replays if g else 0}},
        }

    def client_step(self, client_id: str) -> int:
        self.claim(client_id)
        with self.lock:
            return self.ledger.last_step(client_id)

    def claim(self, key: str) -> None:
        """Replicas (``--state-dir``): hold the newest state of client ``key`` before serving it
        (:mod:`.clientstate`); a no-op otherwise. Any thread."""
        if self.states is not None:
            self.compute.run(self.states.claim, key)

    # -- training ----------------------------------------------------------------------

    def to_model(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(device=self.device, dtype=self.dtype, non_blocking=True)

    def train_step(self, meta: P.StepMeta, hidden: torch.Tensor, labels: torch.Tensor,
                   mask: Optional[torch.Tensor], positions: Optional[torch.Tensor] = None) -> Answer:
        """2-way: loss of the top on ``hidden``; answer loss + grad of input (see :mod:`.training`).
        ``positions``: the client's ``position_ids`` (B|1, T), or None (derived from the mask)."""
        if self.u_shape:
            raise BadRequest(f"{P.TRAIN_STEP} is for 2-way servers; this one holds the trunk "
                             f"(use {P.TRAIN_FORWARD} and {P.TRAIN_BACKWARD})")
        with self.lock, self._preemptible():
            self.claim(meta.client_id)
            return self.training.step(meta, hidden, labels, mask, positions)

    def train_forward(self, meta: P.StepMeta, hidden: torch.Tensor, mask: Optional[torch.Tensor],
                      labels: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None) -> Answer:
        """U-shape: trunk output for ``hidden``; the graph waits for the backward (see :mod:`.lease`).
        2-way: a piece with ``labels``: the loss (see :mod:`.training`)."""
        if not self.u_shape and labels is None:
            raise BadRequest(f"this server holds the top: send the labels with {P.TRAIN_FORWARD} "
                             f"(or use {P.TRAIN_STEP})")
        if self.u_shape and labels is not None:
            raise BadRequest(f"this server holds the trunk: the labels never leave the client")
        with self.lock, self._preemptible():
            self.claim(meta.client_id)
            return self.training.forward(meta, hidden, mask, labels, positions)

    def train_apply(self, key: str, req: P.ApplyRequest) -> Answer:
        """Apply an open-ended step at the client's learning rate (see :meth:`.Training.apply`)."""
        with self.lock:
            self.claim(key)
            return self.training.apply(key, req)

    def train_backward(self, meta: P.StepMeta, grad: torch.Tensor) -> Answer:
        """Backpropagate ``grad`` of a piece's output; grad of input. Refused, the step is
        dropped (and the lease given back)."""
        with self.lock:
            self.claim(meta.client_id)
            return self.training.backward(meta, grad)

    def _preemptible(self):
        """Training yields to queued decode steps (``--priority decode-first``, :mod:`.priority`):
        points on the base segment and on SplitFed members' copies."""
        if self.preemptor is None:
            return nullcontext()
        members = getattr(self.federation.round, "members", {})
        return self.preemptor.active([self.segment, *(r.segment for r in members.values())])

    def drop_pending(self, client_id: str, release: bool = True, taken_over: bool = False) -> None:
        """A step left unfinished for over the lease timeout (its client vanished), or
        ``taken_over`` by a new run of the same client id, is dropped: gradients freed, lease
        given back; the client's late piece gets 409 and redoes it."""
        with self.lock:
            if taken_over:
                log.warning("client %s started again: the step its last run left unfinished is dropped", client_id)
            else:
                log.warning("client %s left a step unfinished for over %gs: it is dropped",
                            client_id, self.cfg.lease_timeout_s)
            pend = self.ledger.pending(client_id)
            if pend is not None:
                pend.state.rep.optimizer.zero_grad(set_to_none=True)
                release_step(pend.state, self.memory)  # its graphs' and answers' reservations
            self.ledger.set_pending(client_id, None)
            if release:  # (not when the lease itself expires it: it is taking the lease over)
                self.lease.release(client_id)

    def applied(self, meta: P.StepMeta, answer: Answer, pieces: Optional[dict] = None,
                forwards: Optional[dict] = None) -> None:
        """Record the step; checkpoint when due; tell the client which of its steps is durable."""
        total = self.ledger.applied(meta.client_id, meta.step, answer, pieces, forwards, seal=False)
        every = self.cfg.checkpoint_every
        if self.cfg.checkpoint_dir and every and total % every == 0:
            self.checkpoint()
        if self.states is not None:  # replicas: this client's own state, every N of its steps
            self.states.applied(meta.client_id, meta.step)
        answer.meta["durable"] = str(self.ledger.durable_step(meta.client_id))
        self.ledger.seal(meta.client_id)  # the answers final: kept as bytes (reserved) or digests

    # -- federation --------------------------------------------------------------------

    def sync(self, key: str, weights: dict[str, torch.Tensor]) -> dict:
        """Client ``key``'s client-side weights at the end of its turn or round (none with
        ``--client-weights external``): checked against the schema, weighted by the target
        tokens this server trained and aggregated by the federation (:mod:`splitlearn.server.federation.modes`)."""
        with self.lock:
            return self.federation.sync(key, weights)

    def shared_weights(self) -> Answer:
        version, weights = self.federation.latest()
        return Answer(weights, {"version": str(version)})

    # -- inference ---------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, mask: Optional[torch.Tensor],
                labels: Optional[torch.Tensor], wire_dtype: str, all_logits: bool = False,
                positions: Optional[torch.Tensor] = None) -> Answer:
        """No-grad forward for evaluation: trunk output, or (top) the last position's logits and,
        if labels are given, the loss, computed in chunks of positions (:mod:`splitlearn.model.headloss`):
        the (B, T, V) logits never exist, unless ``all_logits`` asks for every position's (B, T, V)."""
        with self.lock:
            self.segment.eval()
            pos = positions.to(self.device) if positions is not None else None
            out = self.segment(self.to_model(hidden), mask, position_ids=pos, head=False)  # (B, T, d)
            if self.u_shape:
                return Answer(pack(P.HIDDEN, out, wire_dtype))
            seg = self.segment
            last = out if all_logits else out[:, -1, :]  # (B, T, d) or (B, d)
            tensors = pack(P.LOGITS, seg.logits(last), wire_dtype)  # (B, T, V) or (B, V)
            if labels is not None:
                tensors[P.LOSS] = head_loss(seg, out, labels).float().reshape(1).cpu()
        return Answer(tensors)

    def open_session(self, owner: str, rows: int, tenant: str = "") -> Session:
        if not 1 <= rows <= self.cfg.max_batch:
            raise BadRequest(f"rows must be in 1..{self.cfg.max_batch}, got {rows}")
        return self.sessions.open(owner, rows, tenant)

    def session_step(self, sess: Session, position: int, hidden: torch.Tensor,
                     mask: Optional[torch.Tensor], wire_dtype: str, ops: CacheOps = CacheOps(),
                     step: Optional[int] = None, logits: Optional[int] = None,
                     positions: Optional[torch.Tensor] = None) -> Future:
        """Run the new positions through the segment with the session's cache.

        ``mask`` (rows, T) covers the new positions only; the session keeps the mask of the
        earlier ones, so a decode step's request does not grow with the sequence. ``ops``: the
        cache operations to apply first (reorder rows, crop; :mod:`.sessions`), ``step``: the
        step's number in its session (exactly once), ``logits``: a top answers the logits of the
        last ``logits`` new positions (B, k, V) (0: all; None: the last, as (B, V));
        ``positions``: the first segment's position ids of the new positions (default: from the
        session's mask, the same rule; docs/MODELS.md). Decode
        steps (T = 1) go through the :class:`DecodeBatcher`, batched with concurrent ones;
        queueing one is safe from any thread (everything that reads or changes the session
        or the model runs in the item's ``prepare``, on the compute thread). A prefill
        (T > 1) runs at once: call it on the compute thread. Returns a future of the
        :class:`Answer`: wait for it off the compute thread.
        """
        T = hidden.shape[1]
        began = []  # [True] once this step has begun (its failure then ends the session's step)

        def prepare() -> Optional[torch.Tensor]:  # under the lock, right before computing
            sess.begin(step, position, ops, T, self.sessions)  # Replay/409/400/429, or ops applied
            began.append(True)
            sess.mask = _extend_mask(sess.mask, mask, sess.rows, position, T)  # (B, past + T)
            return None if sess.mask is None else sess.mask.to(self.device)

        def finish(out: torch.Tensor) -> Answer:  # (B, T, d|V) -> the answer
            if self.segment.has_head:
                last = out[:, -1, :] if logits is None else (out[:, -logits:] if logits else out)
                answer = Answer(pack(P.LOGITS, last, wire_dtype))  # (B, V) or (B, k, V)
            else:
                answer = Answer(pack(P.HIDDEN, out, wire_dtype))  # (B, T, d)
            sess.end(answer, numbered=step is not None)
            return answer

        def adapter():  # the session's LoRA adapter, None: the base model
            return self.adapters.adapter_for(sess.client_id, self.cfg.federation) if self.adapters else None

        if T == 1:
            item = DecodeItem(sess.cache, hidden, finish=finish, key=sess.id, owner=sess.owner,
                              positions=None if positions is None else positions.to(self.device))

            def prepare_decode() -> Optional[torch.Tensor]:
                full = prepare()
                item.hidden, item.adapter = self.to_model(hidden), adapter()  # (B, 1, d)
                return full

            item.prepare = prepare_decode
            return _answered(self.batcher.enqueue(item), sess, began)
        done: Future = Future()
        try:
            with self.lock, torch.no_grad(), lora_scope(self.segment, adapter()), self.inference():
                full = prepare()
                self.segment.eval()
                keep = 1 if logits is None else logits
                pos = None if positions is None else positions.to(self.device)
                out = self.segment(self.to_model(hidden), full, sess.cache, pos, logits_to_keep=keep)  # (B, T, d) or (B, k, V)
            done.set_result(finish(out))
        except Replay as r:
            done.set_result(r.answer)
        except Exception:
            if began:  # begun, then failed: the step's number is spent, its answer lost
                sess.end(None, numbered=False)
            raise
        return done

    def close_session(self, owner: str, session_id: str) -> None:
        self.sessions.close(owner, session_id)
        self.batcher.forget(session_id)  # no decode batch waits for its next step

    # -- persistence -------------------------------------------------------------------

    def checkpoint(self) -> Optional[str]:
        """Save segment, optimizer state and step ledger to ``--checkpoint-dir``; with
        ``--state-dir``, every client's state that is not durable yet."""
        if self.states is not None:
            self.compute.run(self.states.save_all)
        if not self.cfg.checkpoint_dir:
            return None
        with self.lock:
            if self.federation.round_open():
                # a splitfed round's copies are not saved: its checkpoint comes when it closes
                log.info("checkpoint deferred: splitfed round %d is open", self.federation.round.number)
                return None
            t = time.perf_counter()
            counters = {**self.ledger.to_counters(), "federation": self.federation.counters(),
                        "grad_clip": self.grad_clip.state()}
            shared = self.federation.client_weights
            extra = {"federation": shared} if shared is not None else {}
            if self.adapters is not None:  # LoRA: every adapter + optimizer, in this generation
                extra["adapters"], counters["adapters"] = self.adapters.state()
            save_state(self.cfg.checkpoint_dir, "server", [self.segment], self.optimizer, counters,
                       extra=extra or None)
            self.ledger.mark_durable()
            log.info("checkpoint saved to %s in %.2fs", self.cfg.checkpoint_dir, time.perf_counter() - t)
        return self.cfg.checkpoint_dir

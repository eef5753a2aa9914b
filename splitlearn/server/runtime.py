"""The server's segment and everything that changes it: training steps, sessions, checkpoints.

One :class:`SegmentRuntime` per process holds one copy of the segment. It loads the segment
on, and runs every method that touches tensors on, its :class:`~.compute.ComputeThread`
(why one thread: see :mod:`.compute`), and a lock guards the state that other threads read,
so concurrent requests are safe; the WSGI server's threads overlap reading and writing bytes
with computation.

Exactly-once training steps. Each client numbers its steps 1, 2, 3...; the runtime keeps,
per client, the last step applied and the bytes it answered. A request for that same step
is a retry and gets the stored bytes back without touching the weights; a request for any
step other than the next gets 409.
"""
from __future__ import annotations

import base64
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import protocol as P
from ..checkpoint import has_state, load_state, make_optimizer, save_state
from ..devices import dtype_name, resolve_device, resolve_dtype
from ..errors import BadRequest, Conflict
from ..export import load_segment, read_segment_spec
from ..loading import load_model
from ..partition import partition
from ..segments import Segment, loss_from_logits
from ..wire import encode, pack
from .batching import DecodeBatcher, DecodeItem
from .compute import ComputeThread, on_compute_thread
from .config import ServerConfig
from .sessions import Session, SessionStore

log = logging.getLogger(__name__)


@dataclass
class _Pending:  # a U-shape forward waiting for its backward
    step: int
    inputs: torch.Tensor  # (B, T, d), requires grad
    outputs: torch.Tensor  # (B, T, d), holds the graph
    response: bytes


@dataclass
class _Progress:
    step: int = 0  # last step applied
    response: bytes = b""  # the answer to it, replayed to retries
    pending: Optional[_Pending] = None


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


class SegmentRuntime:
    def __init__(self, cfg: ServerConfig, compute: Optional[ComputeThread] = None):
        self.cfg = cfg
        self.compute = compute or ComputeThread(cfg.torch_threads)
        self.compute.run(self._load)

    def _load(self) -> None:
        cfg = self.cfg
        self.segment, self.cuts = build_segment(cfg)
        self.config = self.segment.config
        self.device = next(self.segment.parameters()).device
        self.dtype = next(self.segment.parameters()).dtype
        self.optimizer = make_optimizer(self.segment.parameters(), cfg.optimizer, cfg.lr,
                                        cfg.weight_decay)
        self.lock = threading.RLock()
        self.clients: dict[str, _Progress] = {}
        self.sessions = SessionStore(self.segment.new_cache, cfg.session_ttl_s, cfg.max_sessions,
                                     cfg.max_tokens_per_client)
        self.batcher = DecodeBatcher(self.segment, self.compute, self.lock, batching=cfg.batching)
        self.steps_applied = 0
        if cfg.checkpoint_dir and has_state(cfg.checkpoint_dir, "server"):
            counters = load_state(cfg.checkpoint_dir, "server", [self.segment], self.optimizer)
            answers = counters.get("answers", {})  # base64 of each client's last answer
            self.clients = {c: _Progress(step=s, response=base64.b64decode(answers.get(c, "")))
                            for c, s in counters["clients"].items()}
            self.steps_applied = counters["steps_applied"]
            log.info("resumed from %s: %d steps applied", cfg.checkpoint_dir, self.steps_applied)

    # -- description -------------------------------------------------------------------

    @property
    def u_shape(self) -> bool:
        return self.segment.kind == "trunk"

    def info(self) -> dict:
        c = self.cfg
        return {
            "protocol_version": P.PROTOCOL_VERSION,
            "model_config": self.config.to_dict(),
            "cuts": list(self.cuts),
            "segment": {"kind": self.segment.kind, "blocks": list(self.segment.blocks)},
            "shape": "u" if self.u_shape else "2-way",
            "labels_leave_client": not self.u_shape,
            "compute_dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "wire_dtypes": ["float32", "bfloat16", "float16", "int8"],
            "optimizer": {"name": c.optimizer, "lr": c.lr, "weight_decay": c.weight_decay},
            "limits": {"max_body_bytes": c.max_body_bytes, "max_batch": c.max_batch,
                       "n_positions": self.config.n_positions, "max_sessions": c.max_sessions,
                       "max_tokens_per_client": c.max_tokens_per_client,
                       "session_ttl_s": c.session_ttl_s},
        }

    def client_step(self, client_id: str) -> int:
        with self.lock:
            return self.clients.get(client_id, _Progress()).step

    # -- training ----------------------------------------------------------------------

    def _progress(self, meta: P.StepMeta) -> tuple[_Progress, Optional[bytes]]:
        """The client's progress, and the stored answer if this request is a retry."""
        prog = self.clients.setdefault(meta.client_id, _Progress())
        if meta.step == prog.step and prog.response:
            return prog, prog.response
        return prog, None

    def _expect_next(self, prog: _Progress, meta: P.StepMeta) -> None:
        if meta.step != prog.step + 1:
            raise Conflict(f"step {meta.step} for client {meta.client_id!r} is out of order: "
                           f"the server has applied step {prog.step}, so the next is {prog.step + 1}")

    def _to_model(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(device=self.device, dtype=self.dtype, non_blocking=True)

    @on_compute_thread
    def train_step(self, meta: P.StepMeta, hidden: torch.Tensor, labels: torch.Tensor,
                   mask: Optional[torch.Tensor]) -> bytes:
        """2-way: loss of the top on ``hidden``; optimizer step; answer loss + grad of input."""
        if self.u_shape:
            raise BadRequest(f"{P.TRAIN_STEP} is for 2-way servers; this one holds the trunk "
                             f"(use {P.TRAIN_FORWARD} and {P.TRAIN_BACKWARD})")
        with self.lock:
            prog, replay = self._progress(meta)
            if replay is not None:
                return replay
            self._expect_next(prog, meta)
            self.segment.train()
            h = self._to_model(hidden).requires_grad_()  # (B, T, d)
            logits = self.segment(h, mask)  # (B, T, V)
            loss = loss_from_logits(logits, labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            body = encode({**pack(P.GRAD, h.grad, meta.wire_dtype),
                           P.LOSS: loss.detach().float().reshape(1)}, meta.to_meta())
            self._applied(prog, meta.step, body)
            return body

    @on_compute_thread
    def train_forward(self, meta: P.StepMeta, hidden: torch.Tensor, mask: Optional[torch.Tensor]) -> bytes:
        """U-shape: trunk output for ``hidden``; the graph waits for the backward."""
        if not self.u_shape:
            raise BadRequest(f"{P.TRAIN_FORWARD} is for U-shape servers; this one holds the top "
                             f"(use {P.TRAIN_STEP})")
        with self.lock:
            prog = self.clients.setdefault(meta.client_id, _Progress())
            if prog.pending is not None and prog.pending.step == meta.step:
                return prog.pending.response
            self._expect_next(prog, meta)
            self.segment.train()
            h = self._to_model(hidden).requires_grad_()  # (B, T, d)
            out = self.segment(h, mask)  # (B, T, d)
            body = encode(pack(P.HIDDEN, out, meta.wire_dtype), meta.to_meta())
            prog.pending = _Pending(meta.step, h, out, body)
            return body

    @on_compute_thread
    def train_backward(self, meta: P.StepMeta, grad: torch.Tensor) -> bytes:
        """U-shape: backpropagate ``grad`` of the trunk output; optimizer step; grad of input."""
        with self.lock:
            prog, replay = self._progress(meta)
            if replay is not None:
                return replay
            pend = prog.pending
            if pend is None or pend.step != meta.step:
                raise Conflict(f"no forward pending for step {meta.step} of client "
                               f"{meta.client_id!r}: send {P.TRAIN_FORWARD} first")
            if grad.shape != pend.outputs.shape:
                raise BadRequest(f"grad has shape {list(grad.shape)}, the forward of step "
                                 f"{meta.step} produced {list(pend.outputs.shape)}")
            self.optimizer.zero_grad(set_to_none=True)
            pend.outputs.backward(self._to_model(grad))
            self.optimizer.step()
            body = encode(pack(P.GRAD, pend.inputs.grad, meta.wire_dtype), meta.to_meta())
            prog.pending = None
            self._applied(prog, meta.step, body)
            return body

    def _applied(self, prog: _Progress, step: int, body: bytes) -> None:
        prog.step, prog.response = step, body
        self.steps_applied += 1
        every = self.cfg.checkpoint_every
        if self.cfg.checkpoint_dir and every and self.steps_applied % every == 0:
            self.checkpoint()

    # -- inference ---------------------------------------------------------------------

    @on_compute_thread
    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, mask: Optional[torch.Tensor],
                labels: Optional[torch.Tensor], wire_dtype: str) -> bytes:
        """No-grad forward for evaluation: trunk output, or (top) the loss if labels are given."""
        with self.lock:
            self.segment.eval()
            out = self.segment(self._to_model(hidden), mask)
        if self.u_shape:
            return encode(pack(P.HIDDEN, out, wire_dtype))
        tensors = pack(P.LOGITS, out[:, -1, :], wire_dtype)  # (B, V): the next-token logits
        if labels is not None:
            tensors[P.LOSS] = loss_from_logits(out, labels).float().reshape(1)
        return encode(tensors)

    def open_session(self, owner: str, rows: int) -> Session:
        if not 1 <= rows <= self.cfg.max_batch:
            raise BadRequest(f"rows must be in 1..{self.cfg.max_batch}, got {rows}")
        return self.sessions.open(owner, rows)

    @on_compute_thread
    def session_step(self, sess: Session, position: int, hidden: torch.Tensor,
                     mask: Optional[torch.Tensor], wire_dtype: str) -> Future:
        """Run the new positions through the segment with the session's cache.

        ``mask`` (rows, T) covers the new positions only; the session keeps the mask of the
        earlier ones, so a decode step's request does not grow with the sequence. Decode
        steps (T = 1) go through the :class:`DecodeBatcher`, batched with concurrent ones.
        Returns a future of the response bytes: wait for it off the compute thread.
        """
        T = hidden.shape[1]

        def prepare() -> Optional[torch.Tensor]:  # under the lock, right before computing
            if position != sess.cache.length:
                raise Conflict(f"session {sess.id!r} has seen {sess.cache.length} positions; "
                               f"this step starts at {position}")
            self.sessions.reserve(sess, T)
            sess.mask = _extend_mask(sess.mask, mask, sess.rows, position, T)  # (B, past + T)
            return None if sess.mask is None else sess.mask.to(self.device)

        def finish(out: torch.Tensor) -> bytes:  # (B, T, d|V) -> response bytes
            if self.segment.has_head:
                return encode(pack(P.LOGITS, out[:, -1, :], wire_dtype))  # (B, V)
            return encode(pack(P.HIDDEN, out, wire_dtype))  # (B, T, d)

        h = self._to_model(hidden)
        if T == 1:
            return self.batcher.enqueue(DecodeItem(sess.cache, h, prepare, finish))
        with self.lock, torch.no_grad():
            full = prepare()
            self.segment.eval()
            out = self.segment(h, full, sess.cache, logits_to_keep=1)  # (B, T, d) or (B, 1, V)
        done: Future = Future()
        done.set_result(finish(out))
        return done

    # -- persistence -------------------------------------------------------------------

    @on_compute_thread
    def checkpoint(self) -> Optional[str]:
        """Save segment, optimizer state and step counters to ``--checkpoint-dir``."""
        if not self.cfg.checkpoint_dir:
            return None
        with self.lock:
            t = time.perf_counter()
            counters = {"clients": {c: p.step for c, p in self.clients.items()},
                        # so a retry of the last step after a restart is replayed, not refused
                        "answers": {c: base64.b64encode(p.response).decode()
                                    for c, p in self.clients.items() if p.response},
                        "steps_applied": self.steps_applied}
            save_state(self.cfg.checkpoint_dir, "server", [self.segment], self.optimizer, counters)
            log.info("checkpoint saved to %s in %.2fs", self.cfg.checkpoint_dir, time.perf_counter() - t)
        return self.cfg.checkpoint_dir

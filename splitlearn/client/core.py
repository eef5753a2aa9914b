"""``SplitClient``: split training and generation as one object, over the model classes.

The client holds the bottom (2-way) or the bottom and the top (U-shape); the server holds
the rest. :attr:`SplitClient.model` is the client's segments as a
:class:`~splitlearn.hf.modeling.SplitGPT2LMHeadModel` (the same modules, no copy). A training
step is that model's forward and backward inside a *closed* step
(:meth:`RemoteSegment.closed_step <splitlearn.hf.remote.RemoteSegment.closed_step>`), then the
client's optimizer step::

    2-way:   ids -> bottom -> h --POST /v1/train/step (h, labels)--> loss, dL/dh -> bottom.backward
    U-shape: ids -> bottom -> h1 --POST /v1/train/forward--> h2 -> top -> loss
             loss.backward -> dL/dh2 --POST /v1/train/backward--> dL/dh1 -> bottom.backward

the server applying its optimizer (its own learning rate) with the step's last piece. In 2-way
the labels (the text itself) go to the server; in the U-shape they never leave the client. N
split steps equal N unsplit steps (float32 wire). In 2-way the server's LM head is its own
copy of the tied ``wte`` weight (the two live in different processes), so 2-way training
equals an unsplit model with untied embeddings; the U-shape keeps them tied.

What this class adds to the model: the waits and redos of the federation modes, the crash
journal (:mod:`.recovery`; a journaled step is redone through the same model with the
server's stored answers), ``save``/``load``, the greedy two-group decode fast path, the
command line's options (:class:`~.config.ClientConfig`).
"""
from __future__ import annotations

import copy
import logging
import os
import time
import uuid
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from transformers import StoppingCriteriaList

from .. import protocol as P
from ..checkpoint import has_state, load_state, make_optimizer, save_state, unique_parameters
from ..devices import resolve_device
from ..errors import (ConfigError, Conflict, NotYourTurn, ServiceUnavailable, SplitLearnError, StaleWeights,
                      TransportError)
from ..export import load_segments
from ..generation import GreedyConfig
from ..loading import load_model
from ..partition import partition
from ..segments import Segment, labels_from_batch, positions_from_mask
from ..trust import check_info
from . import lora as client_lora
from ..transport.fedsync import FederationState, untied_weights, wait_while_busy
from ..idlepoll import IdlePoller
from ..packed import PackedLinears
from .config import ClientConfig
from .recovery import (Entry, Redo as _Redo, Journal, Snapshot, load_snapshot, prune_entries, read_entries, snapshot_of,
                       write_entry)
from .generation import RemoteDecoder, stream_tokens, use_pipeline
from ..transport import Transport, TransportConfig

log = logging.getLogger(__name__)


class SplitClient:
    """Client of a splitlearn server.

    url: the server, e.g. ``http://127.0.0.1:8000``.
    model: the same model source the server was started with (spec name, directory, JSON,
        hub id, a ``GPT2LMHeadModel``), or a directory of exported segments.
    config: a :class:`~splitlearn.client.config.ClientConfig` holding the options below; each
        option may also be given as a keyword (it overrides the config's field). Bad options
        raise ``ConfigError`` before the client contacts the server.

    The options (``ClientConfig``'s fields):

    token: bearer token (default ``$SPLITLEARN_TOKEN``).
    optimizer, lr, weight_decay: the client's optimizer (``adamw`` or ``sgd``).
    device: ``auto``, ``cpu`` or ``cuda``. wire_dtype: ``float32``, ``bfloat16``,
    ``float16`` or ``int8`` for the tensors this client sends and asks for.
    client_id: this data owner's name on the server (1-64 of ``[A-Za-z0-9_.-]``; default
    random). wait_timeout_s: the longest this client waits for a busy segment, a
    sequential turn or a splitfed round before raising ``ServiceUnavailable``.
    defense: a :class:`splitlearn.privacy.Defense` (``GaussianNoise``, ``NoPeek``) applied to
    every activation this client sends, in training, evaluation and generation.
    fed_url: a separate fed server (``python -m splitlearn.server.fedavg``) that averages the
    client-side weights, so the segment server never sees them (its ``--client-weights external``).
    fed_token: the fed server's own bearer token for this client's tenant (default
    ``$SPLITLEARN_FED_TOKEN``); the segment server's token is never sent to the fed server, so
    the segment server's operator cannot download the client-side weights with it.
    micro_batches: split each training batch into this many micro-batches and keep requests in
    flight so client and server compute at once (GPipe; see :mod:`splitlearn.hf.pipeline`).
    reconnect_timeout_s: how long a training step waits for a crashed server to come back
    before raising ``TransportError``; then the client replays the steps the server lost
    (see :mod:`splitlearn.client.recovery` for what it keeps to do so).
    lora: per-client LoRA adapters on a server started with ``--lora-r`` (a ``peft.LoraConfig``
    or :class:`splitlearn.lora.LoraSpec` of the server's options, or ``"server"`` to take them
    from the server); see :mod:`splitlearn.client.lora`.
    packed_weights: generate on oneDNN prepacked copies of the client's linear weights (CPU
    float32; faster for a few rows, a second copy of those weights in memory; see
    :mod:`splitlearn.packed`).
    poll_idle: keep this process's cores polling instead of sleeping while the server works
    (:class:`splitlearn.idlepoll.IdlePoller`, Linux): less latency per step, for the cores'
    idle time; stopped by :meth:`close`.
    seed: seeds a spec model's weights (use the server's). timeout_s, retries: one call's read
    timeout and its retries on a broken connection. journal_dir: where the crash journal is
    kept so a crashed client can resume (:meth:`load`; docs/RECOVERY.md).
    min_client_blocks (default 1: a server cut at 0, which would get the raw embeddings, is
    refused), expected_cuts, shape (``"u"``: a 2-way server, which would get the labels, is
    refused): the splits this client accepts, checked on the server's ``/v1/info`` before
    anything is sent (:mod:`splitlearn.trust`, which also checks every answer).
    """

    def __init__(self, url: str, model, config: Optional[ClientConfig] = None, **options):
        c = self.config = ClientConfig.of(config, **options)  # validated before any call
        self.poller: Optional[IdlePoller] = None
        self.transport = Transport(TransportConfig(url, c.token or os.environ.get("SPLITLEARN_TOKEN"),
                                                   read_timeout_s=c.timeout_s, retries=c.retries))
        self.info = self.transport.get_json(P.INFO)
        self.cuts = check_info(self.info, c.pins, f"the server at {url}")  # splitlearn.trust: before anything is sent
        self.u_shape = len(self.cuts) == 2
        self.device = resolve_device(c.device)
        self.wire_dtype = c.wire_dtype
        self.segments = self._own_segments(model, c.seed)
        self.bottom = self.segments[0]
        self.top: Optional[Segment] = self.segments[1] if self.u_shape else None
        self.optimizer = make_optimizer(unique_parameters(self.segments), c.optimizer, c.lr, c.weight_decay)
        self.client_id = c.client_id or uuid.uuid4().hex[:16]  # ClientConfig checked a given one
        self.transport.set_route(P.route_key(self.transport.cfg.token, self.client_id))  # replicas: docs/CLUSTER.md
        self.step = 0  # last training step applied on both sides
        self.wait_timeout_s = c.wait_timeout_s  # longest wait for a busy segment, a turn or a round
        fed = None if c.fed_url is None else Transport(TransportConfig(
            c.fed_url, self._fed_token(c.fed_token), read_timeout_s=c.timeout_s, retries=c.retries))
        self.federation = FederationState(self.transport, self.client_id, self.segments, c.wait_timeout_s, fed)
        self.reconnect_timeout_s = c.reconnect_timeout_s  # longest wait for a restarting server
        self.lora = client_lora.setup(self, c.lora, c.seed)  # peft adapters; the optimizer trains them alone
        self.defense = c.defense  # splitlearn.privacy.Defense: applied to every activation sent
        self.micro_batches = c.micro_batches  # pipelined training (see .pipeline)
        self.journal = Journal(enabled=bool(self.info.get("checkpoint", {}).get("enabled")))
        self.journal_dir = Path(c.journal_dir) if c.journal_dir is not None else None  # survives a client crash
        self.journal.start(self._snapshot)
        if self.journal_dir is not None and not has_state(self.journal_dir, "client"):
            self._persist()  # step 0: a resume without a later snapshot starts here
        self.recoveries: list[dict] = []  # one entry per recovery: the server's step, steps replayed
        # generation's linear layers on prepacked weights (packed on their first product)
        self._packed = PackedLinears(torch.nn.ModuleList(self.segments)) if c.packed_weights else None
        self._model = None  # self.model: these segments as a SplitGPT2LMHeadModel, made on first use
        if c.poll_idle:  # last: a failed set-up leaves no pollers behind
            self.poller = IdlePoller().start()

    # -- set-up ------------------------------------------------------------------------

    def _fed_token(self, fed_token: Optional[str]) -> str:
        """The fed server's token: given, or ``$SPLITLEARN_FED_TOKEN``; never the segment server's."""
        fed_token = fed_token or os.environ.get("SPLITLEARN_FED_TOKEN")
        if not fed_token:
            raise ConfigError("fed_url needs the fed server's own token: fed_token=... or $SPLITLEARN_FED_TOKEN "
                              "(the segment server's token is never sent to the fed server)")
        if fed_token == self.transport.cfg.token:
            raise ConfigError("fed_token is the segment server's token: the fed server needs a token of its "
                              "own, or the segment server's operator could download the client-side weights")
        return fed_token

    def _own_segments(self, model, seed: int) -> list[Segment]:
        kinds = ["bottom", "top"] if self.u_shape else ["bottom"]
        if isinstance(model, (str, Path)) and (Path(model) / "bottom.json").is_file():
            segs = [s.to(self.device) for s in load_segments(model, kinds)]
        else:
            m = load_model(model, device=self.device, seed=seed)
            self._check_config(m.config)
            parts = partition(m, self.cuts)
            segs = [parts.bottom, parts.top] if self.u_shape else [parts.bottom]
            # The server's segment dies with `m` and `parts`: the client keeps only its own.
        self._check_config(segs[0].config)
        return segs

    def _check_config(self, cfg) -> None:
        server = self.info["model_config"]
        for key in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"):
            if server.get(key) != getattr(cfg, key):
                raise ConfigError(f"the local model's {key}={getattr(cfg, key)} differs from the "
                                  f"server's {server.get(key)}: load the same model on both sides")

    @property
    def stats(self):
        """Calls, bytes sent/received, (de)serialise time, round trips, server compute."""
        return self.transport.stats

    def close(self) -> None:
        self.transport.close()
        if self.poller is not None:
            self.poller.stop()

    def __enter__(self) -> "SplitClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls -------------------------------------------------------------------------

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        dtype = next(self.bottom.parameters()).dtype
        return x.to(device=self.device, dtype=dtype)

    def _batch(self, input_ids, attention_mask):
        ids = torch.as_tensor(input_ids).to(self.device)
        if ids.ndim == 1:
            ids = ids[None]
        mask = None if attention_mask is None else torch.as_tensor(attention_mask).to(self.device)
        return ids, mask

    # -- training ----------------------------------------------------------------------

    def train_step(self, input_ids, attention_mask=None) -> float:
        """One optimizer step on both sides for a batch (B, T); returns the loss.

        Waits out a busy server (another client's U-shape step, a full splitfed round, a
        sequential turn held by someone else) and redoes the step when the server could not
        apply it as sent (stale client-side weights, a forward dropped after the lease
        timeout): the step is applied exactly once, on the current weights. If the server
        crashed and restarted behind this client, waits for it (``reconnect_timeout_s``) and
        replays the steps it lost (:mod:`.recovery`).
        """
        ids, mask = self._batch(input_ids, attention_mask)
        return self._step(ids, mask, torch.get_rng_state())

    def _step(self, ids, mask, rng: torch.Tensor) -> float:
        labels = labels_from_batch(ids, mask)
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            try:
                self.federation.before_step()
                loss, answers, durable = wait_while_busy(lambda: self._attempt(ids, mask, labels, rng),
                                                         "the segment", max(deadline - time.monotonic(), 0.0))
                break
            except (StaleWeights, NotYourTurn) as e:
                log.info("step %d redone: %s", self.step + 1, e.message)
                self.federation.stale()
            except _Redo as e:
                log.warning("step %d redone: %s", self.step + 1, e)
            except TransportError as e:
                log.warning("server unreachable (%s); waiting up to %gs", e.message, self.reconnect_timeout_s)
                self.transport.wait_until_up(time.monotonic() + self.reconnect_timeout_s, self.reconnect_timeout_s)
                self.recover()
            except Conflict as e:  # out of order: the server restarted behind this client
                if not self.journal.enabled:
                    raise
                log.warning("step %d refused (%s); recovering", self.step + 1, e.message)
                self.recover()
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"step {self.step + 1} could not be applied within "
                                         f"{self.wait_timeout_s:g}s")
        self.optimizer.step()
        self.step += 1
        self.federation.samples += ids.shape[0]
        entry = Entry(self.step, ids, mask, rng, answers)
        self.journal.record(entry)
        if self.journal_dir is not None and self.journal.enabled:
            write_entry(self.journal_dir, entry)
        if durable is not None:
            moved = self.journal.snapshot.step if self.journal.snapshot else None
            self.journal.durable(durable, self.step, self._snapshot, self._roll)
            if self.journal_dir is not None and durable == self.step and durable != moved:
                self._persist()  # the live state is the new snapshot
        return loss

    def _attempt(self, ids, mask, labels, rng: torch.Tensor, replay: Optional[dict] = None):
        """Run the step once through :attr:`model` -> (loss, the server's answers, its durable
        step); on success only ``optimizer.step()`` is left to do. The step is a closed one
        (:meth:`RemoteSegment.closed_step <splitlearn.hf.remote.RemoteSegment.closed_step>`): the
        server applies it, at its own learning rate, with the last backward. ``replay``: the
        answers of a journaled step, to redo it here without a request."""
        model = self.model
        remote = model.remote  # this client's settings now (load() may have changed the id)
        remote.client_id, remote.defense, model.micro_batches = self.client_id, self.defense, self.micro_batches
        torch.set_rng_state(rng)  # every attempt draws the same dropout masks
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        pos = None if mask is None else positions_from_mask(mask, ids.shape[1])  # left padding as generate's
        with model.remote.closed_step(self.step + 1, self.federation.version, replay) as step:
            out = model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=pos)
            out.loss.backward()
        extra = model.transformer.defense_loss  # the defense's own term (NoPeek) is not the task's loss
        loss = float(out.loss.detach()) - (float(extra.detach()) if extra is not None else 0.0)
        return loss, step.answers, step.durable

    def _defend_sent(self, h: torch.Tensor) -> torch.Tensor:
        """The defense's version of an activation ``h`` (B, T, d) sent while generating."""
        return h if self.defense is None else self.defense.apply(h)

    # -- crash recovery (see .recovery) ----------------------------------------------------

    def _snapshot(self) -> Snapshot:
        return snapshot_of(self.step, self.segments, self.optimizer)

    def _apply_local(self, e: Entry) -> None:
        """Redo step ``e`` on this side with the server's stored answers (no request)."""
        self.step = e.step - 1
        self._attempt(e.ids, e.mask, labels_from_batch(e.ids, e.mask), e.rng, replay=e.answers)
        self.optimizer.step()
        self.step = e.step

    def _roll(self, snap: Snapshot, entries: list) -> Snapshot:
        """``snap`` moved forward through ``entries`` (the live state is left as it was)."""
        live = self._snapshot()
        load_snapshot(snap, self.segments, self.optimizer)
        self.step = snap.step
        for e in entries:
            self._apply_local(e)
        moved = self._snapshot()
        if self.journal_dir is not None:
            self._persist()  # the live segments hold the moved snapshot right now
        load_snapshot(live, self.segments, self.optimizer)
        self.step = live.step
        return moved

    def _persist(self) -> None:
        """Write the live state (which is the journal's snapshot) to ``journal_dir``."""
        save_state(self.journal_dir, "client", self.segments, self.optimizer,
                   {"client_id": self.client_id, "step": self.step, "cuts": list(self.cuts)})
        prune_entries(self.journal_dir, self.step)

    def recover(self) -> int:
        """Bring this client back in step with a server that restarted from its checkpoint:
        return to the server's step using the journal, then replay the steps it lost.
        Returns the number of steps replayed."""
        state = self.transport.get_json(P.CLIENT_STATE.format(client_id=self.client_id))
        server = state["step"]
        # what the server holds may be more than its checkpoint: a replica that kept this
        # client's later steps in memory (docs/CLUSTER.md); the journal moves to the durable one
        durable = min(int(state.get("durable", server)), server)
        if server == self.step:  # the server's checkpoint holds every step: nothing to replay
            self.recoveries.append({"server_step": server, "replayed": 0})
            return 0
        if server == self.step + 1:
            # it applied (and saved) the step whose answer this client never got: the retry of
            # that step gets the stored answer from its ledger, nothing is applied twice
            self.recoveries.append({"server_step": server, "replayed": 0})
            return 0
        if server > self.step:
            raise Conflict(f"the server has applied step {server} for client {self.client_id!r}, "
                           f"ahead of this client's {self.step}: resume this client with load()")
        if not self.journal.covers(server):
            kept = self.journal.snapshot.step if self.journal.snapshot else None
            raise Conflict(f"the server restarted at step {server} of client {self.client_id!r}, "
                           f"before the oldest state this client keeps ({kept}); this client is at "
                           f"{self.step}")
        snap, entries = self.journal.snapshot, list(self.journal.entries)
        load_snapshot(snap, self.segments, self.optimizer)
        self.step = snap.step
        for e in entries:
            if e.step <= max(durable, snap.step):
                self._apply_local(e)
        self.journal.start(self._snapshot)
        for e in entries:  # held by the server, not yet durable there: kept in the journal
            if max(durable, snap.step) < e.step <= server:
                self._apply_local(e)
                self.journal.record(e)
        lost = [e for e in entries if e.step > server]
        log.warning("server is at step %d of %d: replaying %d steps", server, entries[-1].step if entries else server,
                    len(lost))
        for e in lost:  # each sets the RNG state it started with: the same dropout masks
            self._step(e.ids, e.mask, e.rng)
        self.recoveries.append({"server_step": server, "replayed": len(lost)})
        return len(lost)

    def sync(self) -> dict:
        """End of a turn (sequential) or round (splitfed): share the client-side weights.

        sequential: uploads them and gives the turn to the next client. splitfed: uploads
        them with the samples trained since the last sync, waits until the round's other
        clients have synced, and continues from the average. shared: a no-op. Returns the
        server's federation status (``GET /v1/federation``).
        """
        if self.lora is not None:  # LoRA: only the client-side adapters are shared (SplitLoRA)
            status = self.federation.sync(client_lora.client_adapter_tensors(self.segments))
        else:
            status = self.federation.sync(untied_weights(self.segments))
        if not self.federation.shared:
            self.journal.start(self._snapshot)  # the server checkpoints at a sync and a round's end
        return status

    @torch.no_grad()
    def evaluate(self, input_ids, attention_mask=None) -> float:
        """Loss on a batch without changing any weight, on either side."""
        ids, mask = self._batch(input_ids, attention_mask)
        model = self.model
        model.eval()
        pos = None if mask is None else positions_from_mask(mask, ids.shape[1])
        with model.remote.loss_only():  # 2-way: the server answers the loss, not (B, T, V) logits
            out = model(input_ids=ids, attention_mask=mask, labels=labels_from_batch(ids, mask), position_ids=pos)
        return float(out.loss)

    # -- persistence -------------------------------------------------------------------

    def save(self, directory: Union[str, Path], server_checkpoint: bool = True) -> Path:
        """Save this side's segments, optimizer state, client id and step to ``directory``.

        Also asks the server to checkpoint now (if it has a checkpoint dir), so the two
        sides' saved states belong to the same step; the journal then restarts from here.
        """
        durable = False
        if server_checkpoint:
            try:
                durable = self.transport.post_json(P.CHECKPOINT, {}).get("saved") is not None
            except SplitLearnError as e:  # a server without --checkpoint-dir
                log.warning("server did not checkpoint: %s", e)
        save_state(directory, "client", self.segments, self.optimizer,
                   {"client_id": self.client_id, "step": self.step, "cuts": list(self.cuts)})
        if durable:
            self.journal.start(self._snapshot)
            prune_entries(directory, self.step)
        return Path(directory)

    def load(self, directory: Union[str, Path]) -> int:
        """Restore a :meth:`save` or a ``journal_dir``; catch up with the server; return the step.

        A plain save must be at the server's step for this client. A journal directory may be
        behind the server (the client crashed): the logged steps the server has applied are
        re-applied here with its stored answers, the others are sent again. If the server is
        one step past the log, train on with that step's batch: the server answers it from
        its ledger without applying it twice.
        """
        if not has_state(directory, "client"):
            raise ConfigError(f"no client checkpoint in {directory}")
        counters = load_state(directory, "client", self.segments, self.optimizer)
        if tuple(counters["cuts"]) != self.cuts:
            raise ConfigError(f"checkpoint was made with cuts {counters['cuts']}, server has {list(self.cuts)}")
        self.client_id, self.step = counters["client_id"], int(counters["step"])
        self.federation.client_id = self.client_id
        self.transport.set_route(P.route_key(self.transport.cfg.token, self.client_id))
        entries = read_entries(directory, self.step, self.device)
        state = self.transport.get_json(P.CLIENT_STATE.format(client_id=self.client_id))
        server = state["step"]
        last = entries[-1].step if entries else self.step
        if server < self.step or server > last + 1:
            raise Conflict(f"client checkpoint is at step {self.step} (journal to step {last}) but the "
                           f"server has applied step {server} for client {self.client_id!r}: resume both "
                           f"sides from checkpoints of the same step")
        durable = max(self.step, min(int(state.get("durable", server)), server))
        for e in entries:
            if e.step <= durable:
                self._apply_local(e)
        self.journal.start(self._snapshot)
        if self.journal_dir is not None and self.step > int(counters["step"]):
            self._persist()
        for e in entries:
            if durable < e.step <= server:
                self._apply_local(e)
                self.journal.record(e)
        for e in entries:
            if e.step > server:  # logged, but the server lost them (it restarted as well)
                self._step(e.ids, e.mask, e.rng)
        return self.step

    def export_adapter(self, directory: Union[str, Path], base_model: Optional[str] = None) -> Path:
        """LoRA: write both sides' adapters as one peft adapter directory for the whole model
        (``PeftModel.from_pretrained(GPT2LMHeadModel..., directory)``); see :mod:`.lora`."""
        if self.lora is None:
            raise ConfigError("export_adapter needs a LoRA client: SplitClient(..., lora=LoraConfig(...))")
        server = client_lora.fetch_server_adapter(self.transport, self.client_id)
        return client_lora.export_adapter(directory, self.lora, client_lora.client_adapter_tensors(self.segments),
                                          server, base_model)

    # -- generation --------------------------------------------------------------------

    @property
    def model(self):
        """This client as a :class:`splitlearn.SplitGPT2LMHeadModel`: the same modules (the
        segments' embeddings, blocks, ``ln_f`` and head; no copy), this client's connection,
        ``client_id``, wire dtype and defense. Made on first use. :meth:`generate` runs on it;
        use it for anything transformers does with a model (``generate``'s every option,
        ``assistant_model=``, a ``TextStreamer``). Training through it (``loss.backward()``) is
        the model classes' own step protocol: do not mix it with :meth:`train_step` on one
        client."""
        if self._model is None:
            from transformers import GPT2LMHeadModel

            from ..hf.modeling import split_model
            from ..hf.remote import RemoteConfig, RemoteSegment

            config = copy.deepcopy(self.bottom.config)
            with torch.device("meta"):
                hf = GPT2LMHeadModel(config)
            t = hf.transformer
            t.wte, t.wpe, t.drop = self.bottom.wte, self.bottom.wpe, self.bottom.drop
            for seg in self.segments:
                for j, block in enumerate(seg.h):
                    t.h[seg.start + j] = block
            if self.u_shape:
                t.ln_f, hf.lm_head = self.top.ln_f, self.top.lm_head
            c = self.config
            remote = RemoteSegment(RemoteConfig(self.transport.cfg.url, self.transport.cfg.token, self.client_id,
                                                self.wire_dtype, c.timeout_s, c.retries, c.wait_timeout_s,
                                                pins=c.pins),
                                   transport=self.transport, info=self.info, state={"step": self.step})
            remote.log.enabled = False  # this client's own journal (.recovery) replays whole steps
            remote.defense = self.defense
            model = split_model(hf, remote=remote)
            model.packed_weights = False  # this client's own prepacked weights (self._packed) serve it
            model.micro_batches = self.micro_batches
            self._model = model
        return self._model

    def _generate_kwargs(self, ids: torch.Tensor, max_new_tokens: int, do_sample: bool, temperature: float,
                         top_k: Optional[int], top_p: Optional[float], eos_token_id: Optional[int],
                         pad_token_id: Optional[int], kwargs: dict) -> dict:
        """transformers ``generate`` arguments with this method's historical meaning: no top-k or
        top-p unless given, ``eos_token_id=None`` never stops early, finished rows padded with
        ``pad_token_id`` (default: the eos)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        n_pos = self.bottom.config.n_positions
        if ids.shape[1] + max_new_tokens > n_pos:
            raise ConfigError(f"prompt of {ids.shape[1]} tokens + max_new_tokens={max_new_tokens} "
                              f"passes the model's n_positions={n_pos}")
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {top_p}")
        pad = pad_token_id if pad_token_id is not None else eos_token_id
        out = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, eos_token_id=eos_token_id,
                   pad_token_id=pad if pad is not None else 0)
        if do_sample:
            out.update(temperature=temperature, top_k=top_k or 0, top_p=top_p if top_p is not None else 1.0)
        return {**out, **kwargs}

    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 32, do_sample: bool = False,
                 temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Optional[int] = None, seed: Optional[int] = None,
                 pad_token_id: Optional[int] = None, pipeline: Optional[bool] = None,
                 **generate_kwargs) -> torch.LongTensor:
        """Prompt + new tokens (B, T + new), like ``model.generate``; prompts left-padded.

        transformers' ``generate`` on :attr:`model` (so ``generate_kwargs`` may be any of its
        options: ``num_beams``, ``repetition_penalty``, ``assistant_model``, ``streamer``,
        ``stop_strings`` with ``tokenizer``...). ``seed`` seeds sampling reproducibly without
        touching the global RNG. ``eos_token_id=None`` never stops early. ``pipeline``: greedy
        decoding of two rows or more as two row groups in flight (the decode fast path; None:
        in the U-shape when the server does not share this process's cores; see
        :mod:`splitlearn.client.generation`), only without ``generate_kwargs``."""
        ids, mask = self._batch(input_ids, attention_mask)
        if not do_sample and not generate_kwargs and use_pipeline(self.transport, ids.shape[0], pipeline, self.u_shape):
            new = list(self.generate_stream(ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                            pad_token_id=pad_token_id, pipeline=pipeline))
            return torch.cat([ids] + [t[:, None] for t in new], dim=1)
        kw = self._generate_kwargs(ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
                                   pad_token_id, generate_kwargs)
        return self._hf_generate(ids, mask, seed, kw)

    def _hf_generate(self, ids: torch.Tensor, mask: Optional[torch.Tensor], seed: Optional[int], kw: dict):
        model = self.model
        model.eval()
        if mask is None:
            mask = torch.ones_like(ids)
        with self._packed.active() if self._packed is not None else nullcontext():
            if seed is None:
                return model.generate(input_ids=ids, attention_mask=mask, **kw)
            with torch.random.fork_rng(devices=[ids.device] if ids.device.type == "cuda" else []):
                torch.manual_seed(seed)
                return model.generate(input_ids=ids, attention_mask=mask, **kw)

    def generate_stream(self, input_ids, attention_mask=None, max_new_tokens: int = 32, do_sample: bool = False,
                        temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                        eos_token_id: Optional[int] = None, seed: Optional[int] = None,
                        pad_token_id: Optional[int] = None, pipeline: Optional[bool] = None,
                        **generate_kwargs) -> Iterator[torch.Tensor]:
        """Yield the next token of every row, (B,), as each arrives (same arguments as
        :meth:`generate`; a streamer of transformers' ``generate`` underneath). Closing the
        iterator early stops the generation at its next token."""
        ids, mask = self._batch(input_ids, attention_mask)
        if not do_sample and not generate_kwargs and use_pipeline(self.transport, ids.shape[0], pipeline, self.u_shape):
            cfg = GreedyConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
            self._generate_kwargs(ids, max_new_tokens, False, 1.0, None, None, eos_token_id, pad_token_id, {})
            remote = RemoteDecoder(self.transport, self.segments, ids.shape[0], self.wire_dtype, self._local,
                                   client_id=self.client_id if self.lora is not None else None,
                                   defend=self._defend_sent)
            try:
                with self._packed.active() if self._packed is not None else nullcontext():
                    yield from remote.decode(ids, mask, cfg)
            finally:
                remote.close()
            return
        kw = self._generate_kwargs(ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
                                   pad_token_id, generate_kwargs)
        criteria = StoppingCriteriaList(kw.pop("stopping_criteria", None) or [])
        yield from stream_tokens(lambda streamer, stop: self._hf_generate(
            ids, mask, seed, {**kw, "streamer": streamer, "stopping_criteria": StoppingCriteriaList([*criteria, stop])}))

"""``SplitClient``: split training and generation as one object, over the model classes.

The client holds the bottom (2-way) or the bottom and the top (U-shape); the server holds
the rest. :attr:`SplitClient.model` is the client's segments as a
:class:`~splitlearn.hf.modeling.SplitGPT2LMHeadModel` (the same modules, no copy). A training
step is that model's forward and backward as an open-ended step whose loss's gradient is known
to be 1 (:attr:`RemoteSegment.loss_gradient <splitlearn.hf.remote.RemoteSegment.loss_gradient>`),
then the client's optimizer step and the server's apply (at the server's own learning rate),
carried by the next step's first request::

    2-way:   ids -> bottom -> h --POST /v1/train/step (h, labels, loss_scale)--> loss, dL/dh -> bottom.backward
    U-shape: ids -> bottom -> h1 --POST /v1/train/forward--> h2 -> top -> loss
             loss.backward -> dL/dh2 --POST /v1/train/backward--> dL/dh1 -> bottom.backward

one request per micro-batch in 2-way, two in the U-shape, no apply request (the apply goes as
one of its own only before a sync, a save, an evaluation or a generation). In 2-way
the labels (the text itself) go to the server; in the U-shape they never leave the client. N
split steps equal N unsplit steps (float32 wire). In 2-way the server's LM head is its own
copy of the tied ``wte`` weight (the two live in different processes), so 2-way training
equals an unsplit model with untied embeddings; the U-shape keeps them tied.

Everything else is the model's: the handshake and the pins (:class:`~splitlearn.hf.remote.RemoteSegment`),
LoRA (:mod:`splitlearn.hf.lora`), the federation modes and a separate fed server
(:mod:`splitlearn.hf.federation`), the crash journal (the model's request log,
:mod:`splitlearn.hf.journal`: on disk with ``journal_dir``). What this class adds: a batch in,
one step out (the redos of a refused step, its batch noted in the journal so that :meth:`load`
runs it again), ``save``/``load`` of its segments, the command line's options
(:class:`~.config.ClientConfig`).
"""
from __future__ import annotations

import copy
import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from transformers import StoppingCriteriaList

from .. import protocol as P
from ..checkpoint import has_state, load_state, make_optimizer, save_state, unique_parameters
from ..devices import resolve_device
from ..errors import ConfigError, NotYourTurn, ServiceUnavailable, SplitLearnError, StaleWeights
from ..export import load_segments
from ..loading import load_model
from ..partition import partition
from ..segments import Segment, labels_from_batch, positions_from_mask
from ..hf.federation import federation_of, shared_weights
from ..hf.lora import apply_lora, export_adapter
from ..hf.modeling import _check_config, split_model
from ..hf.remote import RemoteConfig, RemoteSegment
from ..transport.fedsync import wait_while_busy
from ..idlepoll import IdlePoller
from ..packed import PackedLinears
from .config import ClientConfig
from ..hf.journal import Redo as _Redo, RequestLog
from .generation import stream_tokens

log = logging.getLogger(__name__)


def _model_over(segments: list[Segment], remote: RemoteSegment, u_shape: bool):
    """``segments`` as a :class:`~splitlearn.hf.modeling.SplitGPT2LMHeadModel` over ``remote``:
    the segments' embeddings, blocks, ``ln_f`` and head themselves (no copy)."""
    from transformers import GPT2LMHeadModel

    config = copy.deepcopy(segments[0].config)
    with torch.device("meta"):
        hf = GPT2LMHeadModel(config)
    t = hf.transformer
    t.wte, t.wpe, t.drop = segments[0].wte, segments[0].wpe, segments[0].drop
    for seg in segments:
        for j, block in enumerate(seg.h):
            t.h[seg.start + j] = block
    if u_shape:
        t.ln_f, hf.lm_head = segments[1].ln_f, segments[1].lm_head
    model = split_model(hf, remote=remote)
    model.packed_weights = False  # the client's own prepacked weights (SplitClient._packed) serve it
    return model


class SplitClient:
    """Client of a splitlearn server.

    url: the server, e.g. ``http://127.0.0.1:8000``.
    model: the same model source the server was started with (spec name, directory, JSON,
        hub id, a ``GPT2LMHeadModel``), or a directory of exported segments.
    config: a :class:`~splitlearn.client.config.ClientConfig` holding the options below; each
        option may also be given as a keyword (it overrides the config's field). Bad options
        raise ``ConfigError`` before the client contacts the server.

    The options are :class:`~splitlearn.client.config.ClientConfig`'s fields: the connection
    (``token``, ``timeout_s``, ``retries``, ``wait_timeout_s``, ``reconnect_timeout_s``), the
    client's optimizer (``optimizer``, ``lr``, ``weight_decay``), ``device``, ``wire_dtype``,
    ``client_id``, ``seed`` (a spec model's weights: use the server's), the model's features
    (``defense``, ``micro_batches``, ``lora``, ``fed_url``/``fed_token``: see
    :class:`~splitlearn.hf.modeling.SplitGPT2LMHeadModel`), ``journal_dir`` (the crash journal
    on disk, for :meth:`load`; docs/RECOVERY.md), ``packed_weights`` (generation on oneDNN
    prepacked weights, :mod:`splitlearn.packed`), ``poll_idle``
    (:class:`splitlearn.idlepoll.IdlePoller` until :meth:`close`) and the pins
    (``min_client_blocks``, ``expected_cuts``, ``shape``: :mod:`splitlearn.trust`).
    """

    def __init__(self, url: str, model, config: Optional[ClientConfig] = None, **options):
        c = self.config = ClientConfig.of(config, **options)  # validated before any call
        self.poller: Optional[IdlePoller] = None
        self.device = resolve_device(c.device)
        self.wire_dtype = c.wire_dtype
        # the model classes' handshake: /v1/info, the pins (splitlearn.trust), the fed server's token
        remote = RemoteSegment(RemoteConfig(url, c.token, c.client_id, c.wire_dtype, c.timeout_s, c.retries,
                                            c.wait_timeout_s, c.reconnect_timeout_s, c.pins, c.fed_url, c.fed_token),
                               state={"step": 0})
        try:
            self.transport, self.info, self.cuts, self.u_shape = remote.transport, remote.info, remote.cuts, remote.u_shape
            self.segments = self._own_segments(model, c.seed)
            self.bottom = self.segments[0]
            self.top: Optional[Segment] = self.segments[1] if self.u_shape else None
            self._model = _model_over(self.segments, remote, self.u_shape)  # the same modules, no copy
            self.defense, self.micro_batches = c.defense, c.micro_batches  # see :attr:`model`
            lora = apply_lora(self._model, c.lora, seed=c.seed)  # peft adapters; the optimizer trains them alone
            self.lora = getattr(self._model, "lora_spec", None)
            self.optimizer = make_optimizer(lora or unique_parameters(self.segments), c.optimizer, c.lr,
                                            c.weight_decay)
            self.federation = federation_of(self._model)  # the modes' waits and weights (transport.fedsync)
            remote.auto_apply = False  # train_step applies, at the server's lr; no optimizer hook does
            remote.loss_gradient = 1.0  # loss.backward(): fused 2-way pieces, 1F1B micro-batches
        except BaseException:
            remote.close()
            raise
        self.step = 0  # last training step applied on both sides
        self.wait_timeout_s = c.wait_timeout_s  # longest wait for a busy segment, a turn or a round
        self.reconnect_timeout_s = c.reconnect_timeout_s  # longest wait for a restarting server
        self.journal_dir = Path(c.journal_dir) if c.journal_dir is not None else None  # survives a client crash
        # generation's linear layers on prepacked weights (packed on their first product)
        self._packed = PackedLinears(torch.nn.ModuleList(self.segments)) if c.packed_weights else None
        self._snap_step = 0  # the step of the client checkpoint in journal_dir
        if self.journal_dir is not None:  # the model's request log is the journal
            remote.log.open(self.journal_dir)
            if not has_state(self.journal_dir, "client"):
                self._persist()  # step 0: a resume without a later checkpoint starts here
        if c.poll_idle:  # last: a failed set-up leaves no pollers behind
            self.poller = IdlePoller().start()

    # -- set-up ------------------------------------------------------------------------

    @property
    def client_id(self) -> str:
        return self._model.remote.client_id

    @client_id.setter
    def client_id(self, client_id: str) -> None:  # load(): the saved one
        self._model.remote.client_id = self.federation.client_id = client_id
        self.transport.set_route(P.route_key(self.transport.cfg.token, client_id))  # replicas: docs/CLUSTER.md

    @property
    def defense(self):
        """A :class:`splitlearn.privacy.Defense` on every activation sent (the model's)."""
        return self._model.defense

    @defense.setter
    def defense(self, defense) -> None:
        self._model.defense = defense

    @property
    def micro_batches(self) -> int:
        """Each training batch in this many pipelined micro-batches (the model's)."""
        return self._model.micro_batches

    @micro_batches.setter
    def micro_batches(self, m: int) -> None:
        self._model.micro_batches = m

    def _own_segments(self, model, seed: int) -> list[Segment]:
        kinds = ["bottom", "top"] if self.u_shape else ["bottom"]
        if isinstance(model, (str, Path)) and (Path(model) / "bottom.json").is_file():
            segs = [s.to(self.device) for s in load_segments(model, kinds)]
        else:
            m = load_model(model, device=self.device, seed=seed)
            _check_config(m.config, self.info)
            parts = partition(m, self.cuts)
            segs = [parts.bottom, parts.top] if self.u_shape else [parts.bottom]
            # The server's segment dies with `m` and `parts`: the client keeps only its own.
        _check_config(segs[0].config, self.info)
        return segs

    @property
    def stats(self):
        """Calls, bytes sent/received, (de)serialise time, round trips, server compute."""
        return self.transport.stats

    def close(self) -> None:
        try:
            self._model.remote.flush()  # the last step's deferred apply
        except SplitLearnError as e:
            log.warning("the last step's apply could not be sent: %s", e.message)
        self.transport.close()
        if self._model.remote.fed is not None:
            self._model.remote.fed.close()
        if self.poller is not None:
            self.poller.stop()

    def __enter__(self) -> "SplitClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls -------------------------------------------------------------------------

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
        replays the steps it lost (the model's request log, :mod:`splitlearn.hf.journal`).
        """
        ids, mask = self._batch(input_ids, attention_mask)
        return self._step(ids, mask, torch.get_rng_state())

    def _step(self, ids, mask, rng: torch.Tensor, noted: bool = False) -> float:
        labels = labels_from_batch(ids, mask)
        remote = self.model.remote
        if not noted:  # journal_dir: the batch, so that a resumed client can run this step again
            remote.log.note(self.step + 1, {"ids": ids, "rng": rng, **({"mask": mask} if mask is not None else {})})
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            try:
                self.federation.before_step()
                loss = wait_while_busy(lambda: self._attempt(ids, mask, labels, rng),
                                       "the segment", max(deadline - time.monotonic(), 0.0))
                break
            except (StaleWeights, NotYourTurn) as e:
                log.info("step %d redone: %s", self.step + 1, e.message)
                self.federation.stale()
            except _Redo as e:
                log.warning("step %d redone: %s", self.step + 1, e)
            remote.log.drop(self.step + 1)  # what was logged of the refused attempt
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"step {self.step + 1} could not be applied within "
                                         f"{self.wait_timeout_s:g}s")
        self.optimizer.step()
        remote.apply(self._server_lr())  # carried by the next step's first request (or flushed)
        self.step += 1
        if self.journal_dir is not None and remote.log.enabled and remote.log.durable_step > self._snap_step:
            self._persist()  # the server's checkpoint moved past ours: the log before it can go
        return loss

    def _attempt(self, ids, mask, labels, rng: torch.Tensor):
        """Run the step once through :attr:`model` -> its loss; on success only
        ``optimizer.step()`` and the apply are left to do. The step is an open-ended one whose
        loss's gradient is 1 (fused 2-way pieces, 1F1B micro-batches); after a :meth:`load`, a
        step the server has is answered from the journal."""
        model = self.model
        remote = model.remote
        if remote.pieces or remote.answered:  # an earlier attempt's pieces: dropped on both sides
            remote.discard_pending(force=True)
        if not remote.pieces:
            remote.step = self.step + 1
        torch.set_rng_state(rng)  # every attempt draws the same dropout masks
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        pos = None if mask is None else positions_from_mask(mask, ids.shape[1])  # left padding as generate's
        out = model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=pos)
        out.loss.backward()
        extra = model.transformer.defense_loss  # the defense's own term (NoPeek) is not the task's loss
        return float(out.loss.detach()) - (float(extra.detach()) if extra is not None else 0.0)

    # -- crash recovery: the model's request log (splitlearn.hf.journal) -----------------

    @property
    def recoveries(self) -> list[dict]:
        """One entry per recovery from a server restart: ``{"server_step", "replayed"}`` (steps
        replayed; ``"requests"``: how many requests that took)."""
        return [{"server_step": r["server_step"], "replayed": r["steps"], "requests": r["replayed"]}
                for r in self.model.remote.recoveries]

    def flush(self) -> Optional[dict]:
        """Send the last step's apply now (it is carried by the next step's first request):
        before reading the server's weights by other means. Returns the server's answer, or
        None if nothing was deferred. ``sync``, ``save``, ``evaluate``, ``generate`` and
        ``close`` do it by themselves."""
        return self._model.remote.flush()

    def _server_lr(self) -> float:
        """The lr the server's apply asks for: the server's own (``/v1/info``), as before issue 30."""
        return float(self.info.get("optimizer", {}).get("lr", self.config.lr))

    def _persist(self) -> None:
        """Write the live state to ``journal_dir`` as its client checkpoint; drop the log before
        the server's durable step (it holds those steps, and so does the checkpoint)."""
        self.model.remote.flush()  # the server holds the checkpoint's step (and the log its apply)
        save_state(self.journal_dir, "client", self.segments, self.optimizer,
                   {"client_id": self.client_id, "step": self.step, "cuts": list(self.cuts)})
        self._snap_step = self.step
        log = self.model.remote.log
        log.prune(min(log.durable_step, self.step))

    def recover(self) -> int:
        """Bring a server that restarted from its checkpoint back to this client's step: send
        again the logged requests of the steps it lost. Returns the number of steps replayed
        (training calls this by themselves when the server goes away)."""
        remote = self.model.remote
        before = len(remote.recoveries)
        remote.step = max(remote.step, self.step + 1)
        remote._recover()
        return sum(r["steps"] for r in remote.recoveries[before:])

    def sync(self) -> dict:
        """End of a turn (sequential) or round (splitfed): share the client-side weights.

        sequential: uploads them and gives the turn to the next client. splitfed: uploads
        them with the samples trained since the last sync, waits until the round's other
        clients have synced, and continues from the average. shared: a no-op. Returns the
        server's federation status (``GET /v1/federation``).
        """
        self.model.remote.flush()  # the last step's apply, before the turn or the round closes
        status = self.federation.sync(shared_weights(self.model))  # LoRA: the adapters alone (SplitLoRA)
        if not self.federation.shared and self.journal_dir is not None and self.model.remote.log.enabled:
            self._persist()  # the server checkpoints at a sync and a round's end; the average is loaded
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
        self.model.remote.flush()  # the last step's apply: the server's checkpoint holds it
        durable = False
        if server_checkpoint:
            try:
                durable = self.transport.post_json(P.CHECKPOINT, {}).get("saved") is not None
            except SplitLearnError as e:  # a server without --checkpoint-dir
                log.warning("server did not checkpoint: %s", e)
        save_state(directory, "client", self.segments, self.optimizer,
                   {"client_id": self.client_id, "step": self.step, "cuts": list(self.cuts)})
        if durable:  # the server's checkpoint holds every step of this client
            self.model.remote.log.durable(self.step)
            RequestLog(True, directory).prune(self.step)
            if self.journal_dir is not None and Path(directory).resolve() == self.journal_dir.resolve():
                self._snap_step = self.step
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
        if self.journal_dir is not None and Path(directory).resolve() == self.journal_dir.resolve():
            self._snap_step = self.step
        notes = self.model.remote.load_journal(directory, self.step)  # the server brought to this step
        for step in sorted(notes):  # the logged batches: answered from the log if the server has them
            t = notes[step]
            self._step(t["ids"].to(self.device), t["mask"].to(self.device) if "mask" in t else None, t["rng"],
                       noted=True)
        if self.journal_dir is not None and self.step > self._snap_step:
            self._persist()
        return self.step

    def export_adapter(self, directory: Union[str, Path], base_model: Optional[str] = None) -> Path:
        """LoRA: write both sides' adapters as one peft adapter directory for the whole model
        (``PeftModel.from_pretrained(GPT2LMHeadModel..., directory)``); see :mod:`.lora`."""
        if self.lora is None:
            raise ConfigError("export_adapter needs a LoRA client: SplitClient(..., lora=LoraConfig(...))")
        return export_adapter(self.model, directory, base_model)

    # -- generation --------------------------------------------------------------------

    @property
    def model(self):
        """This client as a :class:`splitlearn.SplitGPT2LMHeadModel`: the same modules (the
        segments' embeddings, blocks, ``ln_f`` and head; no copy), this client's connection,
        ``client_id``, wire dtype and defense. :meth:`generate` runs on it;
        use it for anything transformers does with a model (``generate``'s every option,
        ``assistant_model=``, a ``TextStreamer``). Training through it (``loss.backward()``) is
        the model classes' own step protocol: do not mix it with :meth:`train_step` on one
        client. Its request log (``model.remote.log``) is this client's crash journal."""
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
        touching the global RNG. ``eos_token_id=None`` never stops early. ``pipeline``: run
        two rows or more as two row groups in flight, each on its own server session, so the
        server computes one while this client computes the other (any strategy; the tokens are
        the same); None: in the U-shape when the server does not share this process's cores
        (:attr:`SplitGPT2LMHeadModel.overlap <splitlearn.hf.modeling.SplitGenerationMixin.overlap>`)."""
        ids, mask = self._batch(input_ids, attention_mask)
        kw = self._generate_kwargs(ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
                                   pad_token_id, generate_kwargs)
        return self._hf_generate(ids, mask, seed, kw, pipeline)

    def _hf_generate(self, ids: torch.Tensor, mask: Optional[torch.Tensor], seed: Optional[int], kw: dict,
                     pipeline: Optional[bool] = None):
        model = self.model
        model.eval()
        if mask is None:
            mask = torch.ones_like(ids)
        model.overlap = pipeline  # per call: None decides by the server's cores
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
        kw = self._generate_kwargs(ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
                                   pad_token_id, generate_kwargs)
        criteria = StoppingCriteriaList(kw.pop("stopping_criteria", None) or [])
        yield from stream_tokens(lambda streamer, stop: self._hf_generate(
            ids, mask, seed, {**kw, "streamer": streamer, "stopping_criteria": StoppingCriteriaList([*criteria, stop])},
            pipeline))

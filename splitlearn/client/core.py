"""``SplitClient``: split training and generation as one object over the model classes: its
:attr:`~SplitClient.model` does the work (a ``SplitGPT2LMHeadModel`` over the client's segments for
GPT-2; any other family's ``Split<Name>``, the family's own class: :mod:`splitlearn.hf.familyclient`);
this class adds a batch in, one step out (applied at the server's own lr), its optimizer,
``save``/``load`` and :class:`~.config.ClientConfig`'s options. README's SplitClient section.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from ..api import protocol as P
from ..model.arch import arch_of
from ..model.checkpoint import make_optimizer, unique_parameters
from ..model.devices import resolve_device
from ..errors import ConfigError, ForwardLost, NotYourTurn, ServiceUnavailable, SplitLearnError, StaleWeights
from ..hf.federation import federation_of
from ..hf.lora import apply_lora, export_adapter
from ..hf.familyclient import client_model
from ..hf.config import RemoteConfig
from ..hf.remote import RemoteSegment
from ..hf.streaming import stream_tokens
from ..procs.idlepoll import IdlePoller
from ..transport.busy import wait_while_busy
from ..model.segments import labels_from_batch
from .config import ClientConfig

log = logging.getLogger(__name__)


def _model_attr(name: str, doc: str) -> property:
    return property(lambda self: getattr(self._model, name), lambda self, v: setattr(self._model, name, v), doc=doc)


def defense_loss(model):
    """The defense's own loss term of ``model``'s last forward (NoPeek's), or None: the split
    model's ``defense_loss``, else (GPT-2's classes) its trunk's."""
    extra = getattr(model, "defense_loss", None)
    if extra is None:
        extra = getattr(getattr(model, "transformer", None), "defense_loss", None)
    return extra


def _set_defense(model, defense) -> None:
    """``model.defense = defense`` where the split class takes one; a defense it does not take is
    a ConfigError (never dropped silently: docs/MODELS.md, "Not yet")."""
    if isinstance(getattr(type(model), "defense", None), property):
        model.defense = defense
    elif defense is not None:
        raise ConfigError(f"{type(model).__name__} takes no defense yet ({type(defense).__name__}): on this "
                          f"family the activations would travel undefended (docs/MODELS.md, \"Not yet\")")


class SplitClient:
    """Client of the splitlearn server at ``url``.

    model: the server's model source (spec name, directory, JSON, hub id, a model) of any family
        of docs/MODELS.md, or a directory of exported GPT-2 segments.
    config / keyword options: :class:`~splitlearn.client.config.ClientConfig`'s fields (a keyword
        overrides the config's field); bad ones raise ``ConfigError`` before any call. The
        connection (``token``, ``timeout_s``, ``retries``, ``wait_timeout_s``,
        ``reconnect_timeout_s``), the optimizer (``optimizer``, ``lr``, ``weight_decay``),
        ``device``, ``wire_dtype``, ``client_id``, ``seed``, the model's features (``defense``,
        ``micro_batches``, ``lora``, ``fed_url``/``fed_token``, ``packed_weights``), ``journal_dir``,
        ``poll_idle`` and the pins (``min_client_blocks``, ``expected_cuts``, ``shape``).
    """

    def __init__(self, url: str, model, config: Optional[ClientConfig] = None, **options):
        c = self.config = ClientConfig.of(config, **options)
        self.poller: Optional[IdlePoller] = None
        self.device = resolve_device(c.device)
        remote = RemoteSegment(RemoteConfig.of(url, c))  # every connection field; the client id's last step: the server's
        try:
            self.transport, self.info, self.cuts, self.u_shape = remote.transport, remote.info, remote.cuts, remote.u_shape
            # GPT-2: the segments' modules (None for another family: `model` holds the client's modules)
            m, self.segments = client_model(model, remote, self.device, c.seed)
            self._model = m
            self.bottom = self.segments[0] if self.segments else None
            self.top = self.segments[1] if self.segments and self.u_shape else None
            self.arch = arch_of(m.config)
            _set_defense(m, c.defense)
            m.micro_batches, m.packed_weights = c.micro_batches, c.packed_weights
            lora = apply_lora(m, c.lora, seed=c.seed)  # peft adapters; the optimizer trains them alone
            self.lora = getattr(m, "lora_spec", None)
            params = unique_parameters(self.segments) if self.segments else list(m.parameters())
            self.optimizer = make_optimizer(lora or params, c.optimizer, c.lr, c.weight_decay)
            self.federation = federation_of(m)
            remote.loss_gradient = 1.0  # train_step's loss.backward(): fused 2-way pieces, 1F1B
            # every step applied at the server's own lr (this optimizer's lr is the client side's)
            remote.link.fixed_lr = float(self.info.get("optimizer", {}).get("lr", c.lr))
            remote.link.attach(self.optimizer)  # only its steps apply; journal_dir: the step-0 client checkpoint
        except BaseException:
            remote.close()
            raise
        if c.poll_idle:  # last: a failed set-up leaves no pollers behind
            self.poller = IdlePoller().start()

    @property
    def model(self):
        """This client as a split model: a :class:`splitlearn.SplitGPT2LMHeadModel` over its segments'
        modules (GPT-2), the family's ``Split<Name>`` (any other family); its connection,
        ``client_id``, wire dtype and defense; ``model.remote.log`` is its journal.
        Train through it or through :meth:`train_step`, not both on one client."""
        return self._model

    @property
    def client_id(self) -> str:
        return self._model.remote.client_id

    @client_id.setter
    def client_id(self, client_id: str) -> None:  # load(): the saved one
        self._model.remote.client_id = self.federation.client_id = client_id
        self.transport.set_route(P.route_key(self.transport.cfg.token, client_id))  # replicas: docs/CLUSTER.md

    @property
    def step(self) -> int:
        """The last training step applied on both sides."""
        return self._model.remote.step - 1

    @property
    def defense(self):
        """A splitlearn.privacy.Defense on every activation sent (the model's; None: none)."""
        return getattr(self._model, "defense", None)

    @defense.setter
    def defense(self, defense) -> None:
        _set_defense(self._model, defense)

    micro_batches = _model_attr("micro_batches", "Each training batch in this many pipelined micro-batches.")

    @property
    def stats(self):
        """Calls, bytes sent/received, (de)serialise time, round trips, server compute."""
        return self.transport.stats

    @property
    def recoveries(self) -> list[dict]:
        """One entry per recovery from a server restart: ``{"server_step", "replayed", "requests"}``."""
        return [{"server_step": r["server_step"], "replayed": r["steps"], "requests": r["replayed"]}
                for r in self._model.remote.journal.recoveries]

    def close(self) -> None:
        try:
            self._model.remote.close()  # the last step's deferred apply first
        except SplitLearnError as e:
            log.warning("the last step's apply could not be sent: %s", e.message)
        finally:
            if self.poller is not None:
                self.poller.stop()

    def __enter__(self) -> "SplitClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _batch(self, input_ids, attention_mask):
        ids = torch.as_tensor(input_ids).to(self.device)
        mask = None if attention_mask is None else torch.as_tensor(attention_mask).to(self.device)
        return (ids[None] if ids.ndim == 1 else ids), mask

    # -- training ----------------------------------------------------------------------

    def train_step(self, input_ids, attention_mask=None) -> float:
        """One optimizer step on both sides for a batch (B, T) -> its loss. A busy segment is
        waited out, a refused step redone, a restarted server caught up: the step is applied once."""
        ids, mask = self._batch(input_ids, attention_mask)
        self.check_batch(*ids.shape)
        return self._step(ids, mask, torch.get_rng_state())

    def check_batch(self, rows: int, positions: int) -> None:
        """ConfigError, before anything is sent, for a training batch of ``rows`` x ``positions``
        that the model or the server cannot take: more positions than the model's
        (``max_position_embeddings``), or pieces of more rows than the server takes in a request."""
        n_pos, field = self.max_positions
        if n_pos and positions > n_pos:
            raise ConfigError(f"a batch of {positions} tokens per row passes the model's {n_pos} positions "
                              f"({field}): use at most {n_pos}")
        per_piece = -(-rows // max(int(self.micro_batches or 1), 1))
        if self.max_rows and per_piece > self.max_rows:
            raise ConfigError(f"pieces of {per_piece} rows pass the server's {self.max_rows} rows per request "
                              f"(its --max-batch): use at most {self.max_rows} rows, or micro-batches "
                              f"(micro_batches >= {-(-rows // self.max_rows)})")

    @property
    def max_positions(self) -> tuple[Optional[int], str]:
        """(the positions the model has, the config field that says so): a learned position
        table's size (the adapter's field), else ``max_position_embeddings`` (None: unbounded)."""
        field = self.arch.family.max_positions or "max_position_embeddings"
        n = getattr(self._model.config, field, None)
        return (int(n) if n else None), field

    def _step(self, ids, mask, rng: torch.Tensor, noted: bool = False) -> float:
        model, remote = self._model, self._model.remote
        if not noted:  # journal_dir: the batch, so that load() runs this step again
            remote.log.note(self.step + 1, {"ids": ids, "rng": rng, **({"mask": mask} if mask is not None else {})})
        labels = labels_from_batch(ids, mask)
        pos = None if mask is None else self.arch.positions(mask, 0, ids.shape[1])  # left padding as generate's

        def attempt() -> float:
            if remote.pieces or remote.answered:  # an earlier attempt's pieces: dropped on both sides
                remote.steps.discard(force=True)
            torch.set_rng_state(rng)  # every attempt draws the same dropout masks
            model.train()
            self.optimizer.zero_grad(set_to_none=True)
            out = model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=pos)
            out.loss.backward()
            extra = defense_loss(model)  # the defense's own term (NoPeek) is not the task's loss
            return float(out.loss.detach()) - (float(extra.detach()) if extra is not None else 0.0)

        step, deadline = remote.step, time.monotonic() + remote.cfg.wait_timeout_s
        while True:  # a busy segment waited out; a refused attempt dropped on both sides and redone
            try:
                self.federation.before_step()
                loss = wait_while_busy(attempt, "the segment", max(deadline - time.monotonic(), 0.0))
                break
            except (StaleWeights, NotYourTurn) as e:  # the shared weights moved on, or the turn lapsed
                log.info("step %d redone: %s", step, e.message)
                self.federation.stale()
            except ForwardLost as e:  # the server lost or dropped the forward
                log.warning("step %d redone: %s", step, e.message)
            remote.log.drop(step)  # what was logged of the refused attempt
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"step {step} could not be applied within {remote.cfg.wait_timeout_s:g}s")
        self.optimizer.step()  # its hook applies the server's step (remote.link), carried by the next request
        return loss

    def flush(self) -> Optional[dict]:
        """Send the last step's deferred apply now -> the server's answer (None: none deferred)."""
        return self._model.remote.flush()

    def recover(self) -> int:
        """Bring a server that restarted from its checkpoint back to this client's step -> the
        number of steps replayed (training does it by itself)."""
        return self._model.remote.journal.recover()

    def sync(self) -> dict:
        """End of a turn (sequential) or round (splitfed): share the client-side weights (LoRA: the
        adapters) -> the server's federation status; a no-op in shared mode."""
        return self._model.sync()

    @property
    def max_rows(self) -> Optional[int]:
        """Rows the server takes in one request (its ``--max-batch``; None: it does not say)."""
        rows = self.info.get("limits", {}).get("max_batch")
        return int(rows) if rows else None

    def _row_groups(self, n: int) -> list[slice]:
        """``n`` rows as groups of at most :attr:`max_rows` (one group if the server takes them)."""
        rows = self.max_rows or n
        return [slice(s, min(s + rows, n)) for s in range(0, n, rows)]

    @torch.no_grad()
    def evaluate(self, input_ids, attention_mask=None) -> float:
        """Loss on a batch without changing any weight, on either side. More rows than the
        server takes in a request (:attr:`max_rows`) go as several requests; the loss is that of
        the whole batch (each group's mean weighted by its predicted tokens)."""
        ids, mask = self._batch(input_ids, attention_mask)
        groups = self._row_groups(ids.shape[0])
        if len(groups) == 1:
            return self._evaluate(ids, mask)
        total = count = 0.0
        for g in groups:
            m = None if mask is None else mask[g]
            n = float(ids[g].shape[0] * (ids.shape[1] - 1)) if m is None else float(m[:, 1:].sum())
            if n:
                total += self._evaluate(ids[g], m) * n
                count += n
        return total / count if count else float("nan")

    def _evaluate(self, ids, mask) -> float:
        model = self._model
        model.eval()
        pos = None if mask is None else self.arch.positions(mask, 0, ids.shape[1])
        with model.remote.loss_only():  # 2-way: the server answers the loss, not (B, T, V) logits
            out = model(input_ids=ids, attention_mask=mask, labels=labels_from_batch(ids, mask), position_ids=pos)
        return float(out.loss)

    # -- persistence -------------------------------------------------------------------

    def save(self, directory: Union[str, Path], server_checkpoint: bool = True) -> Path:
        """Write this side's weights, optimizer state, client id and step to ``directory`` (a client
        checkpoint: ``Recovery.persist``), the server checkpointing the same step first."""
        remote = self._model.remote
        remote.flush()  # the last step's apply: the server's checkpoint holds it
        if server_checkpoint:
            try:
                if self.transport.post_json(P.CHECKPOINT, {}).get("saved") is not None:
                    remote.log.durable(self.step)  # the server's checkpoint holds every step of this client
            except SplitLearnError as e:  # a server without --checkpoint-dir
                log.warning("server did not checkpoint: %s", e)
        remote.journal.persist(self.optimizer, directory)
        return Path(directory)

    def load(self, directory: Union[str, Path]) -> int:
        """Restore a :meth:`save` or a ``journal_dir``, catch the server up with it and run the
        journal's noted batches again -> the step (docs/RECOVERY.md). ``ConfigError``: no
        checkpoint or other cuts; ``Conflict``: the server is more than one step past it."""
        remote = self._model.remote
        counters = remote.journal.restore(directory, self.optimizer, rng=False)
        self.client_id = counters["client_id"]
        notes = remote.journal.load_journal(directory, int(counters["step"]))  # the server brought to this step
        for step in sorted(notes):  # answered from the log where the server has them
            t = notes[step]
            self._step(t["ids"].to(self.device), t["mask"].to(self.device) if "mask" in t else None, t["rng"],
                       noted=True)
        if remote.log.directory is not None and self.step > remote.journal.snapshot_step:
            remote.journal.persist(self.optimizer)
        return self.step

    def export_adapter(self, directory: Union[str, Path], base_model: Optional[str] = None) -> Path:
        """LoRA: both sides' adapters as one peft adapter directory for the whole model."""
        if self.lora is None:
            raise ConfigError("export_adapter needs a LoRA client: SplitClient(..., lora=LoraConfig(...))")
        return export_adapter(self._model, directory, base_model)

    # -- generation --------------------------------------------------------------------

    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 32, do_sample: bool = False,
                 temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Optional[int] = None, seed: Optional[int] = None,
                 pad_token_id: Optional[int] = None, pipeline: Optional[bool] = None,
                 **generate_kwargs) -> torch.LongTensor:
        """Prompt + new tokens (B, T + new), prompts left-padded: transformers' ``generate`` on
        :attr:`model` (``generate_kwargs``: any of its options). No top-k or top-p unless given;
        ``eos_token_id=None`` never stops early; finished rows are padded with ``pad_token_id``
        (default: the eos); ``seed`` seeds sampling without touching the global RNG; ``pipeline``:
        two row groups in flight (``SplitGPT2LMHeadModel.overlap``; None: where it pays). More rows
        than the server takes in a request (:attr:`max_rows`) are generated group by group, each
        padded to the longest with the pad: greedy and beam search equal one batch's; sampling
        draws each group's tokens on its own (with ``seed``: reproducibly)."""
        ids, mask = self._batch(input_ids, attention_mask)
        groups = self._row_groups(ids.shape[0])
        if len(groups) > 1:  # more rows than the server takes: one generation per group, padded alike
            pad = pad_token_id if pad_token_id is not None else eos_token_id
            outs = [self.generate(ids[g], None if attention_mask is None else mask[g], max_new_tokens, do_sample,
                                  temperature, top_k, top_p, eos_token_id, seed, pad_token_id, pipeline,
                                  **generate_kwargs) for g in groups]
            width = max(o.shape[1] for o in outs)
            return torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad if pad is not None else 0)
                              for o in outs])
        n, t, (n_pos, field) = max_new_tokens, ids.shape[1], self.max_positions
        for ok, bad in ((isinstance(n, int) and n >= 0, f"max_new_tokens must be an integer >= 0, got {n!r}"),
                        (not isinstance(n, int) or not n_pos or t + n <= n_pos,
                         f"prompt of {t} tokens + max_new_tokens={n} passes the model's {field}={n_pos}"),
                        (temperature > 0, f"temperature must be > 0, got {temperature}"),
                        (top_k is None or top_k >= 1, f"top_k must be >= 1, got {top_k}"),
                        (top_p is None or 0 < top_p <= 1, f"top_p must lie in (0, 1], got {top_p}")):
            if not ok:
                raise ConfigError(bad)
        pad = pad_token_id if pad_token_id is not None else eos_token_id
        kw = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, eos_token_id=eos_token_id,
                  pad_token_id=pad if pad is not None else 0)
        if do_sample:
            kw.update(temperature=temperature, top_k=top_k or 0, top_p=top_p if top_p is not None else 1.0)
        kw.update(generate_kwargs)
        model = self._model
        model.eval()
        model.overlap = pipeline  # per call: None decides by the server's cores
        mask = torch.ones_like(ids) if mask is None else mask
        if seed is None:
            return model.generate(input_ids=ids, attention_mask=mask, **kw)
        with torch.random.fork_rng(devices=[ids.device] if ids.device.type == "cuda" else []):
            torch.manual_seed(seed)
            return model.generate(input_ids=ids, attention_mask=mask, **kw)

    def generate_stream(self, input_ids, attention_mask=None, *args, **kwargs) -> Iterator[torch.Tensor]:
        """Yield the next token of every row, (B,), as each arrives (:meth:`generate`'s arguments;
        :mod:`splitlearn.hf.streaming`). Closing the iterator stops generation at its next token."""
        criteria = kwargs.pop("stopping_criteria", None)  # the reader's stop is added to them
        yield from stream_tokens(lambda **k: self.generate(input_ids, attention_mask, *args, **kwargs, **k),
                                 stopping_criteria=criteria)

"""``SplitMixin``: what every split head model has (the remote segment, the optimizer hook,
``zero_grad``, federation's ``sync``, ``micro_batches``, ``defense``, ``from_pretrained``)."""
from __future__ import annotations

import logging

import torch
from transformers import GPT2Model

from ..errors import ConfigError, NotYourTurn, StaleWeights
from .config import SplitOptions, with_options
from .remote import RemoteSegment
from .sources import from_source
from .splittrunk import DefendedModel, check_defense
from .trunk import SplitGPT2Model

log = logging.getLogger(__name__)


class SplitMixin(DefendedModel):
    """What every split head model has: the remote segment, the optimizer hook, ``zero_grad``."""

    @property
    def remote(self) -> RemoteSegment:
        return self.transformer.remote

    @property
    def client_id(self) -> str:
        return self.remote.client_id

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Let only ``optimizer`` apply the server's steps (by default the optimizer holding this
        model's parameters, found at the first backward, does); with a ``journal_dir``, also
        writes the starting checkpoint :meth:`resume` needs. Returns it."""
        self.remote.link.attach(optimizer)
        return optimizer

    def resume(self, optimizer: torch.optim.Optimizer) -> int:
        """After this process was killed: a model made as before (same ``client_id``, same
        ``journal_dir``) and a fresh ``optimizer`` are put back at the journal's client checkpoint,
        the server is brought to it, and the logged steps after it are answered from the journal
        when your loop runs them again. Returns the optimizer step to run again first (1, 2...):
        feed it that step's data. The first run must have attached its optimizer
        (:meth:`attach_optimizer`) before training: that writes the starting checkpoint (with
        the RNG state, so dropout draws the same masks). See :mod:`splitlearn.hf.journal`."""
        return self.remote.journal.resume(optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Both sides: this model's gradients, and the server's pending ones (discarded there)."""
        super().zero_grad(set_to_none=set_to_none)
        if self.transformer.remote is not None:
            self.transformer.remote.steps.discard()

    def __call__(self, *args, **kwargs):
        """``nn.Module.__call__``; a step refused at its first forward by a federation mode (the
        shared client-side weights moved on, or the turn lapsed) loads them, takes the turn and
        runs again (:mod:`splitlearn.hf.federation`)."""
        remote = self.transformer.remote
        if remote is not None and self.training:
            remote.steps.prepare(self)
        try:
            return super().__call__(*args, **kwargs)
        except (StaleWeights, NotYourTurn) as e:
            if remote is None or not remote.steps.refused_for_federation():
                raise
            log.info("the forward of step %d runs again: %s", remote.step, e.message)
            remote.steps.prepare(self)
            return super().__call__(*args, **kwargs)

    def sync(self) -> dict:
        """The end of this owner's turn (sequential) or of its part of a round (splitfed): upload
        the client-side weights; splitfed waits for the round's other members and loads the
        average. A no-op in shared mode. Call it between optimizer steps. Returns the server's
        federation status. With a ``journal_dir`` and an attached optimizer, the client
        checkpoint is written again after it. See :mod:`splitlearn.hf.federation`."""
        from .federation import sync_model

        return sync_model(self, self.transformer.remote)

    #: measure ``micro_batches`` against whole batches over the first training steps and keep the
    #: faster (:class:`splitlearn.hf.pipeline.Chooser`): "auto" (the default) on a CUDA device, True
    #: anywhere, False never (always ``micro_batches``)
    choose_micro_batches = "auto"

    @property
    def micro_batches(self) -> int:
        """Training forwards with ``labels`` split into this many micro-batches, pipelined with
        the server (:mod:`splitlearn.hf.pipeline`); 1: whole. ``SplitGPT2LMHeadModel`` only."""
        return self.__dict__.get("_micro_batches", 1)

    @micro_batches.setter
    def micro_batches(self, m: int) -> None:
        from .pipeline import check_micro_batches

        check_micro_batches(m)
        check_defense(self.defense, True, m)  # the residual design, the gradient defense: whole batches
        if m > 1 and not self.causal_lm:
            raise ConfigError(f"micro_batches works with SplitGPT2LMHeadModel (a causal-LM loss); "
                              f"{type(self).__name__} trains whole batches")
        self.__dict__["_micro_batches"] = m

    def flush(self):
        """Send the last optimizer step's apply now (it is carried by the next step's first
        request): before reading the server's weights by other means. ``sync``, evaluation,
        ``generate``, a client checkpoint and ``close`` do it by themselves. Returns the server's
        answer (``remote.last_apply``), or None if nothing was deferred."""
        remote = self.transformer.remote
        return None if remote is None else remote.flush()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` of the client's side, the last optimizer step's
        apply sent first (:meth:`flush`): what is saved and what the server holds are one step.
        The folder holds the client's weights only: this split class's ``from_pretrained`` loads it
        back (the fingerprint of the weights first loaded kept in its config), and
        ``AutoModelForCausalLM.from_pretrained`` refuses it with a message (its ``config.json``
        names the model type ``splitlearn-split-client``; :mod:`splitlearn.hf.unsplit`). For the
        whole model: ``model.merge_and_unload().save_pretrained(dir)``."""
        from .unsplit import mark_split_folder

        self.flush()
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            mark_split_folder(save_directory, self.config, self.transformer.cuts)
        return out

    def merge_and_unload(self):
        """The whole model, out (peft's word for the same act): the family's plain transformers
        model (``GPT2LMHeadModel``; another head: its plain class) holding the client's weights,
        the server's as they are now (this model's last step applied first) and every LoRA
        adapter merged (both sides'), so that ``unsplit.save_pretrained(dir)`` then
        ``AutoModelForCausalLM.from_pretrained(dir)`` gives this model's logits. The server
        answers only where its operator allows it (``--allow-weight-export``; by default a server
        with one tenant does): else ``Forbidden`` (403), saying so. This split model is left as
        it was. See :mod:`splitlearn.hf.unsplit`."""
        from .unsplit import merge_and_unload

        return merge_and_unload(self)

    @property
    def loss_gradient(self):
        """The gradient ``loss.backward()`` will send into this model's loss, when known in
        advance (``1.0`` for a plain loop; ``1 / k`` for ``(loss / k).backward()``): 2-way pieces
        are then fused (one request each: the server's forward, loss and backward at once) and
        micro-batches run 1F1B (:mod:`splitlearn.hf.pipeline`). A backward with another gradient is
        a ``ConfigError``. None (the default): not known; each piece's backward waits for it."""
        remote = self.transformer.remote
        return None if remote is None else remote.loss_gradient

    @loss_gradient.setter
    def loss_gradient(self, g) -> None:
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0):
            raise ConfigError(f"loss_gradient must be None or a number in (0, 1], got {g!r}")
        self.transformer.remote.loss_gradient = None if g is None else float(g)

    @property
    def split_trunk(self) -> SplitGPT2Model:
        return self.transformer

    # -- construction --------------------------------------------------------------------

    HF_CLASS: type = GPT2Model
    #: its forward computes a causal-LM loss (``SplitGPT2LMHeadModel``): micro-batches and the
    #: decode's row groups run through it
    causal_lm = False

    @classmethod
    @with_options(*SplitOptions.names())
    def from_pretrained(cls, source, *model_args, **kwargs):
        """Build the split model for ``source`` (the sources of :func:`splitlearn.load_model`: a
        spec name, a directory, a config JSON, a hub id, a model) against the server at ``server``,
        whose cuts are read from its ``/v1/info``. The options are the fields of
        :class:`~splitlearn.hf.config.SplitOptions`, each with its help there: the connection
        (:class:`~splitlearn.hf.config.RemoteConfig`: ``server``, ``token``, ``client_id``,
        ``wire_dtype``, the timeouts and ``retries``, ``fed_url``/``fed_token`` for a separate fed
        server (:mod:`splitlearn.hf.federation`), ``journal_dir`` for :meth:`resume`,
        ``apply_wait_s``, and the splits accepted, ``min_client_blocks``, ``expected_cuts`` and
        ``shape``, checked before anything is sent) and what the model adds
        (:class:`~splitlearn.hf.config.ModelOptions`: ``seed``; ``defense``: see :attr:`defense`;
        ``lora``: a ``peft.LoraConfig`` (or ``"server"``) for a server started with ``--lora-r``,
        adapters on both sides for this ``client_id`` (:mod:`splitlearn.hf.lora`);
        ``micro_batches``: see :attr:`micro_batches`). A bad option is a ConfigError before any
        call. Other keyword arguments go to the head's config (``num_labels=3``,
        ``pad_token_id=...``). Only the client's weights are kept; eval mode, as
        ``from_pretrained`` leaves any model."""
        from .lora import apply_lora

        options = SplitOptions.take(kwargs)
        model = from_source(cls.HF_CLASS, source, options, cls, SplitGPT2Model, **kwargs)
        try:
            if options.defense is not None:
                model.defense = options.defense
            model.micro_batches = options.micro_batches
            apply_lora(model, options.lora, seed=options.seed)  # also refuses a model without LoRA on a LoRA server
        except BaseException:
            model.remote.close()
            raise
        return model

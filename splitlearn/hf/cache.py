"""``RemoteCache``: a ``transformers.Cache`` whose server-side layers live in a generation session.

``transformers``' ``generate()`` drives a model's KV cache through the :class:`~transformers.Cache`
API: it reads lengths (``get_seq_length``, ``get_mask_sizes``), reorders rows for beam search
(``reorder_cache``), repeats or selects rows (``batch_repeat_interleave``,
``batch_select_indices``) and drops rejected draft positions in assisted decoding (``crop``).
A split model's cache has two halves::

    RemoteCache
    +-- local: DynamicCache, one slot per model layer; the client's blocks (bottom, and the
    |          top in the U-shape) fill theirs under their global layer_idx, as in Hugging Face
    +-- one server session (POST /v1/sessions, opened by the first remote() with its rows):
               the server's blocks [start, end) keep their keys and values there

Every operation applies to ``local`` at once and is recorded for the server; the recorded
operations travel with the next :meth:`RemoteCache.remote` step (docs/PROTOCOL.md, "Cache
operations") and cost no round trip of their own::

    POST /v1/sessions/<sid>/step    safetensors:
        hidden          (B, T, d)  new positions' activations (the bottom's output), wire dtype
        attention_mask  I64 (B, T) their mask columns (absent: no padding)
        reorder         I64 (B,)   rows of the server's cache to keep, in order (absent: as they are)
    metadata: position (= the length after the crop), step (1, 2, 3... per session), crop (absent:
              nothing dropped), wire_dtype, logits (2-way: how many positions' logits)
    answer: hidden (B, T, d) (U-shape) or logits (B, k, V) of the last k new positions (2-way)

Any sequence of reorders, selections, repeats and crops between two steps folds into one
index (the composition of the row maps) and one length (crops only shorten; rows and positions
commute). Steps are numbered, so a transport retry of a step the server applied gets its stored
answer and never applies a reorder twice. If the server loses the session (expiry, restart, a
replica that died), the next step opens a new one and replays the activations sent so far (kept
on the client, reordered and cropped with the cache) once; ``replay=False`` keeps no history and
raises instead.

Two row groups in flight (:meth:`RemoteCache.row_groups`, ``overlap=True``; the split model
classes' ``generate`` asks for them where the server has cores of its own). Run as one batch,
client and server take turns: each waits while the other computes. A cache with row groups
splits the batch's rows into two groups at its first step, each with a cache of its own (its own
session, client layers and transport lane), and the split model's forward keeps both in flight::

    client: bottom A | bottom B | top A + head A | top B + head B | (generate's choice) | bottom A ...
    server:          | trunk A  | trunk B        |

A step is :meth:`RemoteCache.start` (send, return at once) and :meth:`RemoteCache.finish` (the
answer); :meth:`RemoteCache.remote` is both. Each row's computation is its own, so the groups
give the logits one batch gives, for every strategy: greedy, sampling, beam search (the groups
split at a prompt's block of beams, which beam search reorders within). In greedy decoding
without a logits processor the first group's next step is sent ahead, on its argmax, before
the second group's top runs, so the overlap crosses steps as the server computes the next
step while the client finishes this one (:meth:`RemoteCache.next_inputs`); if ``generate``
chose other tokens (a row stopped by a stop string, say) the step is taken back: the server
drops it with the next step's ``crop``, though it did see that position's activations, as it
sees an assisted decoding's rejected drafts.

Lengths. ``get_seq_length(i)`` and ``get_mask_sizes(q, i)`` answer, for a client layer ``i``,
what its own ``DynamicLayer`` holds (Hugging Face's semantics: a layer not yet filled in this
forward holds the past), and for a server layer the session's length, which grows when
:meth:`RemoteCache.remote` returns. So a model builds its masks at the start of a forward (as
``GPT2Model`` does, at layer 0) or per segment at the segment's first layer, and either is right.
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
from transformers import Cache, DynamicCache, PretrainedConfig

from ..api import protocol as P
from ..api import trust
from ..errors import NotFound
from ..api.wire import check_wire_dtype, pack, unpack
from ..model.segments import droppable, filled
from .ahead import SendAhead

log = logging.getLogger(__name__)


def _delete_session(transport, session_id: str) -> None:
    """Close a server session (a finalizer: holds no reference to the cache)."""
    try:
        transport.delete(P.SESSION.format(session_id=session_id))
    except Exception:  # gone already (expired, restarted): nothing to free
        pass


def _crop_filled(cache, remove: int) -> None:
    """Drop the last ``remove`` positions of ``cache``'s layers that hold any, each through its
    own ``crop(-remove)``: a slot of the server's layers stays empty here (a sliding one cannot crop
    while empty: Gemma 2's assisted decoding). A sliding layer past its window goes back only over
    what it recorded (``activate_past_recording``, which ``generate`` calls for assisted decoding),
    checked first so that a refused crop changes nothing; ``remove == 0`` shrinks a recording
    sliding layer back to ``window - 1`` (transformers' ``crop(0)``)."""
    layers = filled(cache)
    if remove == 0:
        layers = [layer for layer in layers if getattr(layer, "record_past", False)]
    can = min((droppable(layer) for layer in layers), default=remove)
    if can < remove:
        raise ValueError(f"crop(-{remove}): a sliding-window layer of the client keeps only its window's last "
                         f"positions (and those recorded since its last crop, after activate_past_recording()): "
                         f"it can drop {can}")
    for layer in layers:
        layer.crop(-remove)


class RemoteCache(Cache, SendAhead):
    """The KV cache of a split GPT-2: client layers here, server layers in one server session.

    config: the whole model's config (a slot per layer). transport: a
    :class:`splitlearn.transport.Transport` to the server. server_blocks: the blocks the
    server holds, ``[start, end)`` (``/v1/info``'s ``segment.blocks``); server_kind: ``"trunk"``
    (U-shape: the server answers hidden states) or ``"top"`` (2-way: logits). wire_dtype: of the
    activations sent and the answers. client_id: LoRA servers use this client's adapter. lane: the
    transport lane of the steps. replay: keep the activations sent so a lost session is rebuilt.
    overlap, row_block: see :meth:`row_groups`; sending a step ahead: :mod:`.ahead`."""

    def __init__(self, config: PretrainedConfig, transport, *, server_blocks: tuple[int, int],
                 server_kind: str = "trunk", wire_dtype: str = "float32",
                 client_id: Optional[str] = None, lane: int = 0, replay: bool = True,
                 overlap: bool = False, row_block: int = 1):
        if server_kind not in ("trunk", "top"):
            raise ValueError(f"server_kind must be 'trunk' or 'top', got {server_kind!r}")
        start, end = server_blocks
        if not 0 <= start <= end <= config.num_hidden_layers:  # any family's config (docs/MODELS.md)
            raise ValueError(f"server_blocks {server_blocks} do not fit a model of {config.num_hidden_layers} layers")
        self.local = DynamicCache(config=config)
        super().__init__(layers=self.local.layers)  # one list: the client's blocks update it through either
        self.config = config
        self.transport = transport
        self.server_blocks = (start, end)
        self.u_shape = server_kind == "trunk"
        self.wire_dtype = check_wire_dtype(wire_dtype)
        self.client_id = client_id
        self.lane = lane
        self.replay = replay
        self.session_id: Optional[str] = None
        self._finalizer: Optional[weakref.finalize] = None
        self._length = 0  # positions of the server's layers, after the operations pending
        self._rows: Optional[int] = None  # rows after the operations pending (None: none seen yet)
        self._server_rows = 0  # what the server's session holds now
        self._server_length = 0
        self._step = 0  # steps the session took
        self._index: Optional[torch.Tensor] = None  # pending row map, indices into the server's rows
        self._history: list[torch.Tensor] = []  # what was sent, (server rows, server length, d) in pieces
        self._pending: Optional[_Step] = None  # the step in flight (start() without finish())
        if not isinstance(row_block, int) or row_block < 1:
            raise ValueError(f"row_block must be an int >= 1, got {row_block!r}")
        self.overlap, self.row_block = bool(overlap), row_block
        self.groups: Optional[list[tuple[slice, "RemoteCache"]]] = None  # row groups (see row_groups)
        SendAhead.__init__(self)

    @classmethod
    def from_info(cls, config: PretrainedConfig, transport, info: dict, **kwargs) -> "RemoteCache":
        """A cache for the server whose ``/v1/info`` answered ``info``; ``kwargs`` as the constructor's."""
        seg = info["segment"]
        return cls(config, transport, server_blocks=tuple(seg["blocks"]), server_kind=seg["kind"], **kwargs)

    def __repr__(self) -> str:
        if self.groups:
            return f"RemoteCache(groups={[child for _, child in self.groups]})"
        return (f"RemoteCache(length={self._length}, rows={self._rows}, session={self.session_id!r}, "
                f"server_blocks={self.server_blocks})")

    # -- row groups: two sessions in flight -----------------------------------------------

    def row_groups(self, rows: int) -> Optional[list[tuple[slice, "RemoteCache"]]]:
        """The row groups of a step of ``rows`` rows: None (one group: this cache itself), or
        ``[(rows, cache), ...]``, each group's rows (a slice of the batch) with a cache of its
        own (its own session, client layers and transport lane: ``lane``, ``lane + 1``).

        A cache made with ``overlap=True`` splits its rows at its first step when it has two
        blocks of ``row_block`` rows or more (``generate`` expands each prompt into ``num_beams``
        or ``num_return_sequences`` rows: a block, which beam search reorders within): the first
        half of the blocks, then the rest. The split model's forward then runs each group's
        bottom and sends it, and reads each answer and runs that group's top, so the server
        computes one group while the client computes the other (the decode's overlap). Every
        cache operation is applied per group; rows never move from one group to the other
        (``generate`` never moves them)."""
        if self.groups is None and self.overlap and self._rows is None and self._length == 0 \
                and self.session_id is None and rows % self.row_block == 0 and rows >= 2 * self.row_block:
            half = (rows // self.row_block + 1) // 2 * self.row_block
            self.groups = [(slice(0, half), self._child(0)), (slice(half, rows), self._child(1))]
            if self.greedy:  # the first group's steps sent ahead may be taken back (.ahead): its
                self.groups[0][1].activate_past_recording()  # sliding layers keep them until take_ahead's crop(0)
        return self.groups

    def _child(self, i: int) -> "RemoteCache":
        return type(self)(self.config, self.transport, server_blocks=self.server_blocks,
                          server_kind="trunk" if self.u_shape else "top", wire_dtype=self.wire_dtype,
                          client_id=self.client_id, lane=self.lane + i, replay=self.replay)

    def _map_groups(self, index: torch.Tensor) -> None:
        """Apply the row map ``index`` (into all rows) group by group."""
        bounds = torch.tensor([sl.stop for sl, _ in self.groups])
        group_of = torch.bucketize(index, bounds, right=True)  # (R,) the group of each old row
        if bool((group_of[1:] < group_of[:-1]).any()):
            raise ValueError("a cache with row groups keeps each group's rows in its group (the rows "
                             f"{[(sl.start, sl.stop) for sl, _ in self.groups]}); got {index.tolist()}")
        groups, start = [], 0
        for g, (sl, child) in enumerate(self.groups):
            mine = index[group_of == g] - sl.start
            if mine.numel():
                child.batch_select_indices(mine)
                groups.append((slice(start, start + mine.numel()), child))
                start += mine.numel()
            else:
                child.close()
        self.groups = groups

    # -- lengths ------------------------------------------------------------------------

    def _server_layer(self, layer_idx: int) -> bool:
        return self.server_blocks[0] <= layer_idx < self.server_blocks[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached for ``layer_idx``: the client layer's own, or the session's."""
        if self.groups:  # the last group: never a step ahead
            return self.groups[-1][1].get_seq_length(layer_idx)
        if self._server_layer(layer_idx) or layer_idx >= len(self.layers):
            return self._length
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if self.groups:
            return self.groups[-1][1].get_mask_sizes(query_length, layer_idx)
        if self._server_layer(layer_idx) or layer_idx >= len(self.layers):
            return self._length + query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1  # grows up to the model's max_position_embeddings

    @property
    def is_compileable(self) -> bool:
        return False  # a network call sits in the middle of the forward

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def rows(self) -> Optional[int]:
        """Rows of the cache (after pending operations); None before the first step."""
        if self.groups:
            return sum(child.rows or 0 for _, child in self.groups)
        return self._rows

    # -- the server's layers --------------------------------------------------------------

    def remote(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
               logits_to_keep: int = 1) -> torch.Tensor:
        """Run the server's blocks on the new positions ``hidden`` (B, T, d), with the pending
        cache operations applied first, in one round trip.

        attention_mask: (B, past + T) 0/1 of the whole sequence so far (None: no padding); only
        its last T columns travel (the server keeps the rest). logits_to_keep (2-way): the server
        answers the logits of the last k new positions, (B, k, V) (0: all T), as Hugging Face's
        ``logits_to_keep`` (pass the forward's own: ``generate`` sets 1, assisted decoding the
        draft length + 1); a trunk answers every position, so a U-shape ignores it (the client's
        top applies it). Returns the server's answer in ``hidden``'s dtype and device: U-shape
        the trunk's output (B, T, d), 2-way logits (B, k, V). With row groups
        (:meth:`row_groups`) each group's rows go to its own session, all in flight at once.
        """
        if self.groups:
            self._settle()
            steps = [(child, child.start(hidden[sl], _rows(attention_mask, sl), logits_to_keep))
                     for sl, child in self.groups]
            return torch.cat([child.finish(step) for child, step in steps], dim=0)
        return self.finish(self.start(hidden, attention_mask, logits_to_keep))

    def start(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
              logits_to_keep: int = 1) -> "_Step":
        """The first half of :meth:`remote`: send the step on this cache's lane and return at
        once; :meth:`finish` waits for the answer (the caller computes meanwhile)."""
        if self.groups:
            raise ValueError("a cache with row groups steps through remote() or its groups' start()")
        if hidden.ndim != 3:
            raise ValueError(f"hidden must be (B, T, d), got {list(hidden.shape)}")
        B, T, _ = hidden.shape
        past = self._length
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(f"attention_mask must be (B, past + T) = {(B, past + T)}, got "
                             f"{list(attention_mask.shape)} (the cache holds {past} positions)")
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0: all positions), got {logits_to_keep!r}")
        if self._pending is not None:
            raise ValueError("this cache has a step in flight: finish() it first")
        keep = None if self.u_shape else logits_to_keep
        if self.session_id is None:
            self._open(B)
        index = self._pending_index(B)
        crop = past if past < self._server_length else None
        meta = P.SessionStepMeta(past, self.wire_dtype, step=self._step + 1, crop=crop, logits=keep).to_meta()
        tensors = pack(P.HIDDEN, hidden, self.wire_dtype)
        if attention_mask is not None:
            tensors[P.MASK] = attention_mask[:, past:].long().cpu()  # (B, T)
        if index is not None:
            tensors[P.REORDER] = index
        path = P.SESSION_STEP.format(session_id=self.session_id)
        call = self.transport.start_call(path, tensors, meta, self.lane)
        self._pending = _Step(call, hidden, attention_mask, index, past, keep)
        return self._pending

    def finish(self, step: "_Step") -> torch.Tensor:
        """The second half of :meth:`remote`: the answer to ``step`` (from :meth:`start`)."""
        if step is not self._pending:
            raise ValueError("not this cache's step in flight")
        self._pending = None
        hidden, past, keep = step.hidden, step.past, step.keep
        B, T, _ = hidden.shape
        try:
            out = self.transport.finish_call(step.call)
        except NotFound:
            if not self.replay:
                raise
            out = self._replay(hidden, step.mask, step.index, past, keep)
        else:
            self._record(hidden, step.index, past)
        self._step += 1
        self._server_rows, self._server_length = B, past + T
        self._index, self._rows, self._length = None, B, past + T
        shape = (B, T, hidden.shape[-1]) if self.u_shape else \
            (B, T if keep == 0 else min(keep or 1, T), self.config.vocab_size)  # the server's rule (sessions.py)
        name, what = (P.HIDDEN, "trunk output") if self.u_shape else (P.LOGITS, "logits")
        return trust.answer(out, name, shape, what).to(device=hidden.device, dtype=hidden.dtype)  # splitlearn.api.trust

    def abandon(self) -> None:
        """Read and drop the answer of a step in flight (its connection can be reused)."""
        step, self._pending = self._pending, None
        if step is not None:
            try:
                step.call.result()
            except Exception:  # noqa: BLE001 - the answer is dropped either way
                pass

    def _open(self, rows: int) -> None:
        body = {"rows": rows, **({"client_id": self.client_id} if self.client_id else {})}
        self.session_id = self.transport.post_json(P.SESSIONS, body)["session_id"]
        self._finalizer = weakref.finalize(self, _delete_session, self.transport, self.session_id)
        self._finalizer.atexit = False  # at exit the server's TTL frees it; no network then
        self._server_rows, self._server_length, self._step = rows, 0, 0
        if self._length == 0:  # a new cache (or a lost one, replayed): no row map applies
            self._index = None

    def _pending_index(self, B: int) -> Optional[torch.Tensor]:
        """The row map to send with a step of ``B`` rows (None: the rows as they are)."""
        index = self._index
        if index is None and B != self._server_rows:
            if self._length > 0:
                raise ValueError(f"the cache holds {self._rows} rows; this step has {B}")
            index = torch.zeros(B, dtype=torch.long)  # nothing kept: any rows will do
        if index is not None:
            if index.numel() != B:
                raise ValueError(f"the cache holds {index.numel()} rows; this step has {B}")
            if index.numel() == self._server_rows and torch.equal(index, torch.arange(B)):
                return None  # the identity: nothing to send
        return index

    def _record(self, hidden: torch.Tensor, index: Optional[torch.Tensor], past: int) -> None:
        """Keep what was sent, aligned with the server's cache (for a replay)."""
        if not self.replay:
            return
        if self._history and (index is not None or past < self._server_length):
            kept = torch.cat(self._history, dim=1)  # (server rows, server length, d)
            if index is not None:
                kept = kept.index_select(0, index.to(kept.device))
            kept = kept[:, :past]  # (B, past, d)
            self._history = [kept] if past else []
        self._history.append(hidden.detach())

    def _replay(self, hidden: torch.Tensor, mask: Optional[torch.Tensor], index: Optional[torch.Tensor],
                past: int, logits_to_keep: Optional[int]) -> dict:
        """The session is gone: open a new one and send everything kept, then the new positions."""
        self._record(hidden, index, past)
        whole = torch.cat(self._history, dim=1)  # (B, past + T, d)
        T = hidden.shape[1]
        log.warning("generation session %s lost; replaying %d positions", self.session_id, whole.shape[1])
        self.session_id, self._length = None, 0
        if self._finalizer is not None:
            self._finalizer.detach()
        try:
            self._open(whole.shape[0])
            self._history = [whole]
            keep = None if logits_to_keep is None else min(logits_to_keep or T, T)
            meta = P.SessionStepMeta(0, self.wire_dtype, step=1, logits=keep).to_meta()
            tensors = pack(P.HIDDEN, whole, self.wire_dtype)
            if mask is not None:
                tensors[P.MASK] = mask.long().cpu()
            out = self.transport.finish_call(self.transport.start_call(
                P.SESSION_STEP.format(session_id=self.session_id), tensors, meta, self.lane))
        finally:
            self._length = past
        if self.u_shape:
            out = dict(out)
            out[P.HIDDEN] = unpack(out, P.HIDDEN)[:, -T:]  # the new positions' only
            out.pop(P.HIDDEN + ".scale", None)
        return out

    # -- cache operations (transformers' API) ---------------------------------------------

    def _map_rows(self, index: torch.Tensor) -> None:
        """Record the row map ``index`` (into the current rows) for the server."""
        if self._rows is None:  # nothing sent yet: the first step opens the session with its rows
            return
        if self._server_length == 0 and self._length == 0:
            self._rows = int(index.numel())
            self._index = None
            return
        base = self._index if self._index is not None else torch.arange(self._server_rows)
        self._index = base.index_select(0, index)
        self._rows = int(index.numel())

    def _check_index(self, index: torch.Tensor, what: str) -> torch.Tensor:
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        index = index.detach().to("cpu", torch.long).flatten()
        if index.numel() == 0:
            raise ValueError(f"{what}: at least one row must stay")
        rows = self.rows
        if rows is not None and bool(((index < 0) | (index >= rows)).any()):
            raise ValueError(f"{what}: indices must be in [0, {rows}), got {index.tolist()}")
        return index

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` of the cache becomes row ``beam_idx[i]`` of the old one."""
        index = self._check_index(beam_idx, "reorder_cache")
        if self.groups:
            self._settle()
            return self._map_groups(index)
        super().reorder_cache(index)  # the client's layers (index_select of the filled ones)
        self._map_rows(index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (int64, or a bool mask), in that order."""
        index = self._check_index(indices, "batch_select_indices")
        if self.groups:
            self._settle()
            return self._map_groups(index)
        super().batch_select_indices(index)
        self._map_rows(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in a row (``num_return_sequences``, beams from one prompt)."""
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"batch_repeat_interleave: repeats must be a positive int, got {repeats!r}")
        if self.groups:
            self._settle()
            for _, child in self.groups:
                child.batch_repeat_interleave(repeats)
            self.groups = [(slice(sl.start * repeats, sl.stop * repeats), child) for sl, child in self.groups]
            return
        super().batch_repeat_interleave(repeats)
        if self._rows is not None:
            self._map_rows(torch.arange(self._rows).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop positions: ``crop(-k)`` removes the last k (transformers 5), ``crop(0)`` none;
        ``crop(n)`` with n > 0 keeps the first n (transformers 4's ``max_length``; none if the
        cache holds n or fewer). The server drops them with the next step."""
        if self.groups:
            self._settle()
            for _, child in self.groups:
                child.crop(tokens_to_remove)
            return
        n = int(tokens_to_remove)
        length = self._length
        remove = -n if n <= 0 else max(length - n, 0)
        if remove > length:
            raise ValueError(f"crop({n}): the cache holds {length} positions")
        _crop_filled(self, remove)  # the client's layers (crop(0): recording sliding ones shrink back)
        self._length = length - remove

    def reset(self) -> None:
        """Empty the cache: the server's session is closed, the client's layers dropped."""
        self.close()

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Delete the server's session (also done when the cache is garbage-collected) and empty
        the cache; a later :meth:`remote` opens a new session."""
        for _, child in self.groups or ():
            child.close()  # a step sent ahead is read and dropped there
        self.groups, self._ahead, self._finished, self.greedy = None, None, None, False
        self.abandon()
        if self._finalizer is not None:
            self._finalizer()  # runs once
            self._finalizer = None
        self.session_id = None
        self._server_rows = self._server_length = self._step = 0
        self._history = []
        self._index = None
        self._length = 0
        self._rows = None
        super().reset()

    def __enter__(self) -> "RemoteCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Step:
    """A step sent by :meth:`RemoteCache.start`, waiting for :meth:`RemoteCache.finish`."""

    __slots__ = ("call", "hidden", "mask", "index", "past", "keep")

    def __init__(self, call, hidden: torch.Tensor, mask: Optional[torch.Tensor], index: Optional[torch.Tensor],
                 past: int, keep: Optional[int]):
        self.call, self.hidden, self.mask, self.index, self.past, self.keep = call, hidden, mask, index, past, keep


def _rows(x: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    """``x[rows]`` of a per-row tensor; None and a row broadcast to every row (1, ...) as they are."""
    if x is None or x.shape[0] == 1:
        return x
    return x[rows]

"""Greedy decoding with row groups: the first group's next step sent ahead.

With two row groups in flight (:meth:`RemoteCache.row_groups <splitlearn.hf.cache.RemoteCache.row_groups>`)
and greedy decoding without a logits processor, the first group's next step is sent on its
argmax before the second group's top runs, so the server computes the next step while the
client finishes this one. If ``generate`` chose other tokens (a row stopped by a stop string,
say) the step is taken back: its answer read and dropped, the client's layers cropped, and the
server drops the position with the next step's ``crop`` (it did see that position's
activations, as it sees an assisted decoding's rejected drafts). The tokens never depend on it.
"""
from __future__ import annotations

from typing import Optional

import torch


class SendAhead:
    """What :class:`~splitlearn.hf.cache.RemoteCache` keeps to send a step ahead, and the
    calls the split model's forward makes: :meth:`next_inputs`, :meth:`sent_ahead`,
    :meth:`take_ahead`; a cache operation first settles (:meth:`_settle`)."""

    def __init__(self):
        self.greedy = False  # set by generate: greedy choice, no logits processor, rows never move
        self.eos: Optional[torch.Tensor] = None  # ids that end a row (finished rows get ``pad``)
        self.pad: Optional[torch.Tensor] = None
        self.max_length = 0  # generate stops at this many positions: nothing to send ahead then
        self._ahead: Optional[tuple] = None  # (step, bottom context, ids, mask, positions, keep)
        self._finished: Optional[torch.Tensor] = None  # (b,) first-group rows that produced eos

    def next_inputs(self, logits: torch.Tensor, ids: torch.Tensor, mask: Optional[torch.Tensor],
                    positions: Optional[torch.Tensor]) -> Optional[tuple]:
        """Greedy decoding with row groups: the first group's inputs of the next step as
        ``generate`` will make them, from its last-position ``logits`` (b, V) and this step's
        ``ids`` (b, T), ``mask`` (b, past + T) or None and ``positions`` (b or 1, T) or None:
        (ids (b, 1), mask, positions), or None where nothing may be sent ahead.

        The split model's forward runs that group's bottom on them and sends it at once
        (:meth:`sent_ahead`), so the server computes it while this process computes the other
        group's top (and ``generate`` picks the tokens): the overlap crosses the step, as it
        does between two forwards of one group. The next forward takes it if its inputs are
        those (:meth:`take_ahead`), else takes it back: the tokens never depend on it."""
        child = self.groups[0][1]
        if not self.greedy or len(self.groups) < 2 or child._length + 1 >= self.max_length:
            return None
        tok = logits.argmax(-1)  # (b,): generate's greedy choice (no logits processor)
        if self.eos is not None and self.pad is not None and self._finished is not None:
            tok = torch.where(self._finished, self.pad.to(tok), tok)  # finished rows: padding
        nxt_mask = None if mask is None else torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        nxt_pos = None if positions is None else positions[:, -1:] + 1
        return tok[:, None], nxt_mask, nxt_pos

    def sent_ahead(self, step, ctx: dict, ids: torch.Tensor, mask: Optional[torch.Tensor],
                   positions: Optional[torch.Tensor], keep: int) -> None:
        """Keep the first group's step sent ahead (:meth:`next_inputs`) for the next forward."""
        self._ahead = (step, ctx, ids, mask, positions, keep)

    def take_ahead(self, ids: torch.Tensor, mask: Optional[torch.Tensor], positions: Optional[torch.Tensor],
                   keep: int) -> Optional[tuple]:
        """The first group's step sent ahead for exactly these inputs and its bottom's context,
        ``(step, ctx)``; None if there is none, or it was for other inputs (it is then taken
        back: its answer read and dropped, the position dropped on both sides)."""
        child = self.groups[0][1]
        if self.greedy and child._length and ids.shape[1] == 1 and self.eos is not None:
            done = torch.isin(ids[:, -1], self.eos.to(ids.device))  # the token this step feeds
            self._finished = done if self._finished is None else self._finished | done
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            step, ctx, a_ids, a_mask, a_pos, a_keep = ahead
            if not (keep == a_keep and _same(ids, a_ids) and _same(mask, a_mask) and _same(positions, a_pos)):
                child.take_back(step)
                ahead = None
        child.crop(0)  # every position it holds is generate's now: its sliding layers back to window - 1
        return None if ahead is None else (ahead[0], ahead[1])

    def take_back(self, step) -> None:
        """Take back ``step`` (from :meth:`start`): its answer is read and dropped, the client's
        layers and the length go back to what they held before it; the server drops the
        position with the next step (``crop``)."""
        self.finish(step)
        self._length = step.past
        for layer in self.layers:
            extra = layer.get_seq_length() - step.past if layer.is_initialized else 0
            if extra > 0:
                layer.crop(-extra)

    def _settle(self) -> None:
        """Before a cache operation: take back a step sent ahead; no more sending ahead."""
        if self._ahead is not None:
            step = self._ahead[0]
            self._ahead = None
            self.groups[0][1].take_back(step)
        self.greedy, self._finished = False, None


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b.to(device=a.device, dtype=a.dtype)))

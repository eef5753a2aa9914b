"""Streaming generation: each new token of every row as transformers' ``generate`` makes it
(:meth:`SplitGenerationMixin.generate_stream <splitlearn.hf.generation.SplitGenerationMixin.generate_stream>`,
``SplitClient.generate_stream``)."""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

_END = object()


class _TokenQueue(BaseStreamer):
    """A ``generate`` streamer that queues every new token of every row, (B,), prompt excluded."""

    def __init__(self):
        self.queue: "queue.Queue" = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate puts the prompt first
            self._prompt_seen = True
            return
        self.queue.put(value.reshape(-1))

    def end(self) -> None:
        self.queue.put(_END)


class _StopFlag(StoppingCriteria):
    """Stops ``generate`` at its next token once :attr:`stop` is set (the reader went away)."""

    def __init__(self):
        self.stop = threading.Event()

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.stop.is_set(), dtype=torch.bool, device=input_ids.device)


def stream_tokens(generate: Callable[..., object], **kwargs) -> Iterator[torch.Tensor]:
    """Yield each new token of every row, (B,), while ``generate(**kwargs, streamer=...,
    stopping_criteria=...)`` runs in a thread; its exception is re-raised here. Closing the
    iterator early stops the generation at its next token and waits for it (so its server
    session is closed when this returns)."""
    streamer, flag, error = _TokenQueue(), _StopFlag(), []
    criteria = StoppingCriteriaList([*(kwargs.pop("stopping_criteria", None) or []), flag])

    def target():
        try:
            generate(**kwargs, streamer=streamer, stopping_criteria=criteria)
        except BaseException as e:  # noqa: BLE001 - re-raised in the reader's thread
            error.append(e)
        finally:
            streamer.queue.put(_END)  # generate does not call end() when it raises

    thread = threading.Thread(target=target, name="splitlearn-generate", daemon=True)
    thread.start()
    try:
        while True:
            item = streamer.queue.get()
            if item is _END:
                break
            yield item
    finally:
        flag.stop.set()
        thread.join()
    if error:
        raise error[0]

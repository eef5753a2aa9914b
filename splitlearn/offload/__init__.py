"""Masked offload: a GPT-2's linear layers computed by an untrusted server on one-time-padded
inputs, every product verified: the client's side (pads, checks, the channel, the model). See
docs/OFFLOAD.md; the maths both sides share: :mod:`splitlearn.offloadmath`; the server:
``splitlearn.server.engine.offload``."""
from .model import OffloadConfig, OffloadGPT2LMHeadModel

__all__ = ["OffloadConfig", "OffloadGPT2LMHeadModel"]

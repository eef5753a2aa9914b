"""Masked offload: a GPT-2's linear layers computed by an untrusted server on one-time-padded
inputs, every product verified (docs/OFFLOAD.md; Slalom, Tramer & Boneh, ICLR 2019).

``field`` (the arithmetic), ``layers`` (what is offloaded, the wire), ``pads`` (one-time pads
and their precomputed unmasking factors), ``verify`` (Freivalds' check), ``remote`` (one
product over HTTP), ``model`` (``OffloadGPT2LMHeadModel``); the server: ``splitlearn.server.offload``.
"""
from .model import OffloadConfig, OffloadGPT2LMHeadModel

__all__ = ["OffloadConfig", "OffloadGPT2LMHeadModel"]

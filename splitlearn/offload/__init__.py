"""Masked offload: a causal LM's linear layers (any family the adapter knows; docs/MODELS.md)
computed by an untrusted server on one-time-padded inputs, every product verified: the client's
side (pads, checks, the channel, the model). See docs/OFFLOAD.md; the maths both sides share:
:mod:`splitlearn.offloadmath`; the server: ``splitlearn.server.engine.offload``."""
from .model import AutoOffloadModelForCausalLM, OffloadConfig, OffloadGPT2LMHeadModel, offload_class

__all__ = ["AutoOffloadModelForCausalLM", "OffloadConfig", "OffloadGPT2LMHeadModel", "offload_class"]

"""A split GPT-2 as a ``transformers`` model (issue 20): ``SplitGPT2LMHeadModel``,
``SplitGPT2ForSequenceClassification``, ``SplitGPT2Model``, :func:`split_model`; the
server's blocks are a :class:`~.remote.RemoteSegment` whose forward and backward cross the
wire through a ``torch.autograd.Function``. See :mod:`.modeling` and :mod:`.remote`."""
from .modeling import (ServerBlock, SplitGPT2ForSequenceClassification, SplitGPT2LMHeadModel, SplitGPT2Model,
                       split_model)
from .remote import RemoteConfig, RemoteSegment

__all__ = ["RemoteConfig", "RemoteSegment", "ServerBlock", "SplitGPT2ForSequenceClassification",
           "SplitGPT2LMHeadModel", "SplitGPT2Model", "split_model"]

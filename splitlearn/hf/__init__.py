"""A split GPT-2 as a ``transformers`` model (issue 20): ``SplitGPT2LMHeadModel``,
``SplitGPT2ForSequenceClassification``, ``SplitGPT2Model``, :func:`split_model`; the
server's blocks are a :class:`~.remote.RemoteSegment` whose forward and backward cross the
wire through a ``torch.autograd.Function``, and ``generate()`` keeps the server's keys and
values in a :class:`~.cache.RemoteCache`. See :mod:`.modeling`, :mod:`.remote` and :mod:`.cache`."""
from .cache import RemoteCache
from .modeling import (ServerBlock, SplitGenerationMixin, SplitGPT2ForSequenceClassification, SplitGPT2LMHeadModel,
                       SplitGPT2Model, split_model)
from .config import RemoteConfig
from .remote import RemoteSegment

__all__ = ["RemoteCache", "RemoteConfig", "RemoteSegment", "ServerBlock", "SplitGenerationMixin",
           "SplitGPT2ForSequenceClassification", "SplitGPT2LMHeadModel", "SplitGPT2Model", "split_model"]

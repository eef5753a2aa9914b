"""A split GPT-2 as a ``transformers`` model (issue 20): ``SplitGPT2LMHeadModel``,
``SplitGPT2ForSequenceClassification``, ``SplitGPT2Model``, :func:`split_model`; the
server's blocks are a :class:`~.remote.RemoteSegment` whose forward and backward cross the
wire through a ``torch.autograd.Function``, and ``generate()`` keeps the server's keys and
values in a :class:`~.cache.RemoteCache`. See :mod:`.modeling`, :mod:`.remote` and :mod:`.cache`.

The names are imported on first use, so the client's ``--help`` reads :mod:`.config` (its
options) without importing torch."""
from .._lazy import lazy_names

_LAZY = {"AutoSplitModelForCausalLM": ".auto", "RemoteCache": ".cache", "RemoteConfig": ".config", "RemoteSegment": ".remote",
         "ServerBlock": ".trunk", "SplitGenerationMixin": ".generation",
         "SplitGPT2ForSequenceClassification": ".modeling", "SplitGPT2LMHeadModel": ".modeling",
         "SplitGPT2Model": ".trunk", "split_model": ".modeling"}

__all__ = ["AutoSplitModelForCausalLM", "RemoteCache", "RemoteConfig", "RemoteSegment", "ServerBlock", "SplitGenerationMixin",
           "SplitGPT2ForSequenceClassification", "SplitGPT2LMHeadModel", "SplitGPT2Model", "split_model"]

__getattr__, __dir__ = lazy_names(__name__, _LAZY)

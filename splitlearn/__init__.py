"""splitlearn: split learning for Hugging Face GPT-2.

Cut a GPT-2 at block boundaries (2-way or U-shape), prove the split equals the whole, run the
pieces as separate processes over HTTP, and measure what each piece costs.
"""
from .data import ByteTokenizer, get_tokenizer, load_corpus
from .errors import ConfigError, SegmentFileError, SplitLearnError
from .export import export_segments, load_segment, load_segments
from .loading import load_config, load_model
from .partition import Partition, partition, validate_cuts
from .segments import Segment, SegmentCache

__version__ = "0.1.0"

__all__ = [
    "ByteTokenizer", "ConfigError", "Partition", "Segment", "SegmentCache", "SegmentFileError",
    "SplitClient", "SplitLearnError", "export_segments", "get_tokenizer", "load_config",
    "load_corpus", "load_model", "load_segment", "load_segments", "partition", "validate_cuts",
    "OffloadGPT2LMHeadModel",
    "RemoteCache", "SplitGPT2LMHeadModel", "SplitGPT2ForSequenceClassification", "SplitGPT2Model", "split_model",
    "__version__",
]


def __getattr__(name: str):
    # SplitClient is imported on first use, so `import splitlearn` does not import requests.
    if name == "SplitClient":
        from .client import SplitClient

        return SplitClient
    if name == "OffloadGPT2LMHeadModel":  # masked offload (docs/OFFLOAD.md), imported on first use too
        from .offload import OffloadGPT2LMHeadModel

        return OffloadGPT2LMHeadModel
    if name in ("RemoteCache", "SplitGPT2LMHeadModel", "SplitGPT2ForSequenceClassification", "SplitGPT2Model",
                "split_model"):
        from . import hf  # split models as transformers models (issue 20), imported on first use

        return getattr(hf, name)
    raise AttributeError(f"module 'splitlearn' has no attribute {name!r}")

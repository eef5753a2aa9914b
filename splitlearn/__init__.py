"""splitlearn: split learning for Hugging Face GPT-2.

Cut a GPT-2 at block boundaries (2-way or U-shape), prove the split equals the whole, run the
pieces as separate processes over HTTP, and measure what each piece costs.
"""
import importlib

from .procs.openmp import default_spin as _default_spin

_default_spin()  # idle OpenMP threads sleep sooner, if torch is not loaded yet (procs/openmp.py)

# Every name is imported on first use (PEP 562), so `import splitlearn` (and so every
# `python -m splitlearn.X --help`) costs no torch or transformers import: name -> its module.
_LAZY = {
    "ByteTokenizer": "model.data", "get_tokenizer": "model.data", "load_corpus": "model.data",
    "ConfigError": "errors", "SegmentFileError": "errors", "SplitLearnError": "errors",
    "export_segments": "model.export", "load_segment": "model.export", "load_segments": "model.export",
    "load_config": "model.loading", "load_model": "model.loading",
    "Partition": "model.partition", "partition": "model.partition", "validate_cuts": "model.partition",
    "Segment": "model.segments", "SegmentCache": "model.segments",
    "SplitClient": "client",  # requests, imported on first use
    "OffloadGPT2LMHeadModel": "offload",  # masked offload (docs/OFFLOAD.md)
    "AutoOffloadModelForCausalLM": "offload",  # masked offload of any family (docs/OFFLOAD.md)
    "RemoteCache": "hf", "SplitGPT2LMHeadModel": "hf", "SplitGPT2ForSequenceClassification": "hf",
    "SplitGPT2Model": "hf", "split_model": "hf",  # split models as transformers models (issue 20)
    "AutoSplitModelForCausalLM": "hf",  # any family (docs/MODELS.md)
}

__version__ = "0.1.0"

__all__ = [
    "ByteTokenizer", "ConfigError", "Partition", "Segment", "SegmentCache", "SegmentFileError",
    "SplitClient", "SplitLearnError", "export_segments", "get_tokenizer", "load_config",
    "load_corpus", "load_model", "load_segment", "load_segments", "partition", "validate_cuts",
    "OffloadGPT2LMHeadModel", "AutoOffloadModelForCausalLM",
    "RemoteCache", "SplitGPT2LMHeadModel", "SplitGPT2ForSequenceClassification", "SplitGPT2Model", "split_model",
    "AutoSplitModelForCausalLM",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        try:  # a subpackage used as an attribute (`splitlearn.model` after `import splitlearn`)
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'splitlearn' has no attribute {name!r}") from None
    globals()[name] = value  # once: later reads do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


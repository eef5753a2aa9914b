"""What each segment of a split decoder-only model (GPT-2, Llama, Gemma, ...: docs/MODELS.md)
costs, and where to cut it (docs/ANALYSIS.md).

``analyze(AnalysisConfig(model=..., cuts=(2, 10)))`` returns the report; ``build_report(config,
link, do_sweep=True)`` adds the sweep over every cut (what ``analyze_model_performance`` writes)."""
from .._lazy import lazy_names

# imported on first use, so that `analyze_model_performance --help` imports no torch
_LAZY = {"build_report": ".cli", "main": ".cli", "AnalysisConfig": ".core", "analyze": ".core",
         "LinkConfig": ".sweep", "sweep_cuts": ".sweep"}

__all__ = ["AnalysisConfig", "LinkConfig", "analyze", "build_report", "main", "sweep_cuts"]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

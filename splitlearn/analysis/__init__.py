"""What each segment of a split GPT-2 costs, and where to cut it (docs/ANALYSIS.md).

``analyze(AnalysisConfig(model=..., cuts=(2, 10)))`` returns the report; ``build_report(config,
link, do_sweep=True)`` adds the sweep over every cut (what ``analyze_model_performance`` writes)."""
import importlib

# imported on first use, so that `analyze_model_performance --help` imports no torch
_LAZY = {"build_report": ".cli", "main": ".cli", "AnalysisConfig": ".core", "analyze": ".core",
         "LinkConfig": ".sweep", "sweep_cuts": ".sweep"}

__all__ = ["AnalysisConfig", "LinkConfig", "analyze", "build_report", "main", "sweep_cuts"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value

"""What each segment of a split GPT-2 costs, and where to cut it (docs/ANALYSIS.md).

``analyze(AnalysisConfig(model=..., cuts=(2, 10)))`` returns the report; ``build_report(config,
link, do_sweep=True)`` adds the sweep over every cut (what ``analyze_model_performance`` writes)."""
from .cli import build_report, main
from .core import AnalysisConfig, analyze
from .sweep import LinkConfig, sweep_cuts

__all__ = ["AnalysisConfig", "LinkConfig", "analyze", "build_report", "main", "sweep_cuts"]

"""What each segment of a split GPT-2 costs, and where to cut it.

``analyze(AnalysisConfig(model=..., cuts=(2, 10)))`` returns the report (docs/ANALYSIS.md):
per segment and submodule, parameters, MACs/FLOPs (fvcore, cross-checked), latency, peak
memory and bytes out; the bytes crossing each cut; per-operator roofline classes.
``build_report(config, link, do_sweep=True)`` adds the sweep over every cut (what the
``analyze_model_performance`` command writes as JSON).

Modules: counting (MACs three ways), timing (hooked latencies), memory (peaks), roofline
(per operator), traffic (bytes per cut, KV cache, tied weights), core (one report),
sweep (every cut, advice), report (text, JSON, CSV, Markdown), plots (PNG), cli.
"""
from .cli import build_report, main
from .core import AnalysisConfig, analyze
from .sweep import LinkConfig, sweep_cuts

__all__ = ["AnalysisConfig", "LinkConfig", "analyze", "build_report", "main", "sweep_cuts"]

#!/usr/bin/env python
"""Thin entry script: the same as the ``analyze_model_performance`` console command.

    python analysis/analyze_model_performance.py --model random:gpt2 --cut 2 --cut 10 --seq-len 6
"""
import sys

from splitlearn.analysis.cli import main

if __name__ == "__main__":
    sys.exit(main())

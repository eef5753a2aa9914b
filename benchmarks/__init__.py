"""splitlearn benchmarks: run with `make bench` or `python benchmarks/run.py` (see README.md)."""

"""splitlearn.analysis (filled by its issue)."""

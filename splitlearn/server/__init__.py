"""splitlearn.server (filled by its issue)."""

"""splitlearn.client (filled by its issue)."""

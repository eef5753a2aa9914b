"""Federation: the modes, the strategies, the collective, tickets and the fed server."""

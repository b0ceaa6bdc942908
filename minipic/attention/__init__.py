"""Position-free KV (worker processes): span keys stored in their frames, moved inside attention."""

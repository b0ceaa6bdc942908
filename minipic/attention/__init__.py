"""Position-free KV (worker processes): Q-only RoPE, keys rotated inside attention."""

"""Layer 3: exact resume — the resumable sampler and per-rank RNG streams."""

"""Layer 1: where this process sits in the job, and object collectives (rank 0 runs, every rank learns the outcome)."""

"""Layer 7: a folder of numbered checkpoints — the manager, its write lock, rotation, how a run starts."""

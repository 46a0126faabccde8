"""Layer 3: checkpoints as a whole — save, async save, sources, restore, folders and rank agreement."""

"""Layer 5: one checkpoint — save, async save, the restore plan and its apply."""

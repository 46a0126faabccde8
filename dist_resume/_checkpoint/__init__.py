"""Layer 5: one checkpoint read back: the restore plan, its apply as one transaction, resume()."""

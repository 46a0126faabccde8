"""Layer 4: where a checkpoint comes from — any source opened, integrity, a folder's newest valid file, rank agreement."""

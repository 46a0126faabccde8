"""Layer 2: checkpoint files — sniffing, loading, the zip archive read/write, integrity, atomic replace, layouts, convert."""

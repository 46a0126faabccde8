"""Layer 2: torch zip files — sniffing, the records and their CRCs, reading without unpickling, loading, atomic replace."""

"""Layer 0: what every other layer may use — errors, type aliases, tree walking, logging, the version."""

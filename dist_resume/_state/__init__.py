"""Layer 1: live-state logic — key prefixes, optimizer matching and placement, validation, device checks."""

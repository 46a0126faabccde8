"""Layer 2: what a checkpoint's parts are — this toolkit's layout, foreign layouts, detection by content."""

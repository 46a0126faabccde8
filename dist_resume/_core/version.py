"""The package version, in one place (the package, the CLI and every checkpoint's metadata read it here)."""

__version__ = "0.1.0"

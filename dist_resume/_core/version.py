"""The package version, in one place (the package, the CLI, every checkpoint's metadata and pyproject.toml read it here)."""

__version__ = "0.4.0"

"""stofc's version (one place; ``pyproject.toml`` states the same)."""

__version__ = "0.1.0"

"""fanfold's version, named once here (``pyproject.toml`` says the same)."""

__version__ = "0.1.0"

"""leanddp's version: the one place it is written. The package metadata (pyproject.toml reads it
without importing leanddp), ``leanddp.__version__`` and ``build_info()["version"]`` (setup.py
compiles it into the extension) all come from here."""

__version__ = "0.1.0"

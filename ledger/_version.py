"""The package's release (``ledger.__version__``), in a module of its own so that any
layer may read it without importing the package's public names (``ledger/__init__.py``,
the top layer)."""

__version__ = "0.4.1"

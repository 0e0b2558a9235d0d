"""Background work for the ledger (see workers/sweeper.py)."""

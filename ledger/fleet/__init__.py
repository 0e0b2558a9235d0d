"""The fleet simulator behind ``ledger demo``: many multi-turn agent sessions, two
arbiters (naive and the ledger) on the same seeded workload, one comparison table."""

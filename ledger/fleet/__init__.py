"""The simulator behind ``ledger demo``: one scenario per incident record, each run
under a naive arbiter with the record's conditions and under the ledger."""

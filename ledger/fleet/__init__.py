"""The simulator behind ``ledger demo``: one scenario per failure the rules prevent
(docs/rules.md), each run under a naive arbiter and under the ledger (docs/demo.md)."""

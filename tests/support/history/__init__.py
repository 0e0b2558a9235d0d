"""A history checker: concurrent clients record every call (op id, arguments, reply or
unknown outcome) while faults are injected; a checker then replays the history against a
model of the rules (see ``check.py``, ``run.py``, ``client.py``, and
docs/reliability.md#a-history-checker)."""

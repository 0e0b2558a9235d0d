from ledger import Item, Ledger, SessionBudget


def test_admit_and_audit(ledger: Ledger, budget: SessionBudget) -> None:
    s = ledger.open_session("tenant-a/s-42", budget)
    got = s.admit("retrieval", [Item("doc7#3", 410), Item("doc9#1", 388)])
    assert got.charged == 798
    assert s.audit().clean

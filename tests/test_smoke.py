from ledger import Item, Ledger, SessionBudget


def test_admit_and_audit(ledger: Ledger, budget: SessionBudget) -> None:
    s = ledger.open_session("tenant-a/s-42", budget)
    got = s.admit("retrieval", [Item("doc7#3", 410), Item("doc9#1", 388)])
    assert got.charged == 798
    assert s.audit().clean


def test_op_ids_are_distinct_identifiers_across_calls_and_forks() -> None:
    import multiprocessing

    from ledger import protocol
    from ledger.core import new_op_id

    ids = [new_op_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(protocol.ID_RE.fullmatch(i) for i in ids)
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        children = pool.map(_child_op_id, range(4))
    # Each forked child draws its own random part: none repeats the parent's ids.
    assert len({c[:20] for c in children} | {ids[0][:20]}) == 5
    assert not set(children) & set(ids)


def _child_op_id(_: int) -> str:
    from ledger.core import new_op_id

    return new_op_id()

from ledger import Item, Ledger, SessionBudget


def test_admit_and_audit(ledger: Ledger, budget: SessionBudget) -> None:
    s = ledger.open_session("tenant-a/s-42", budget)
    got = s.admit("retrieval", [Item("doc7#3", 410), Item("doc9#1", 388)])
    assert got.charged == 798
    assert s.audit().clean


def test_op_ids_are_distinct_identifiers_across_calls_and_forks() -> None:
    import os
    import warnings

    from ledger import protocol
    from ledger.core import new_op_id

    ids = [new_op_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(protocol.ID_RE.fullmatch(i) for i in ids)
    children = []
    for _ in range(3):  # a bare fork: the child only draws an id and writes it to a pipe
        rfd, wfd = os.pipe()
        with warnings.catch_warnings():  # 3.12+ warns on fork with threads alive
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.write(wfd, new_op_id().encode())
            os._exit(0)
        os.close(wfd)
        children.append(os.read(rfd, 200).decode())
        os.close(rfd)
        os.waitpid(pid, 0)
    # Each forked child draws its own random part: none repeats the parent's ids.
    assert len({c[:20] for c in children} | {ids[0][:20]}) == 4
    assert not set(children) & set(ids)


def test_every_driver_error_maps_into_the_ledger_tree() -> None:
    import redis.exceptions as rex

    from ledger import BackendUnavailable, LedgerError, PermissionDenied
    from ledger.errors import translate

    assert isinstance(translate(rex.ConnectionError("down")), BackendUnavailable)
    assert isinstance(translate(rex.NoPermissionError("NOPERM")), PermissionDenied)
    for exc in (rex.RedisClusterException("blocked in a pipeline"), rex.DataError("bad value")):
        mapped = translate(exc)
        assert type(mapped) is LedgerError and type(exc).__name__ in str(mapped)
    plain = ValueError("not the driver's")
    assert translate(plain) is plain  # the library's own bugs are not disguised

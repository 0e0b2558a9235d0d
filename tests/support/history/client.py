"""One client process of a history run: turns on shared sessions, each call recorded.

``python -m tests.support.history.client CONFIG NAME`` reads the run's configuration (JSON) and
loops until the run's stop file appears: it picks a session, begins a turn (as owner
NAME), makes a few calls in it (admit, release, reserve then settle or void or leave it
to expire), and ends the turn. Every call is written to ``<dir>/<NAME>.jsonl`` twice:
an ``inv`` line before it is sent (op id, arguments, wall time) and a ``ret`` line when
it returned (its result's fields) or failed (the error's class; ``ok`` null when the
outcome is unknown: the backend was unreachable). A process killed with -9 leaves an
``inv`` with no ``ret``: unknown too. Some calls are sent a second time with the same op
id (a duplicate delivery), recorded as calls of their own. Seeded by the run's seed and
NAME; what it does depends on the replies it gets, so a run is reproducible up to the
timing of the faults.

``plant`` (tests only) patches a script's text in this process before the ledger loads
it: the checker must then find the defect.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import random
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

from ledger import (
    BackendUnavailable,
    Consumer,
    Item,
    Ledger,
    LedgerError,
    LedgerSettings,
    Session,
    StaleEpoch,
)
from ledger import scripts as ledger_scripts
from ledger.protocol import Call

WM = Consumer.WORKING_MEMORY

# Defects the tests plant, each a replacement in one script's text (script, old, new).
PLANTS: dict[str, tuple[str, str, str]] = {
    # an op id's stored outcome is never found: a call sent again is applied again
    "replay": ("_common.lua", "if rec then return replay(rec, op, fp) end", "if false then end"),
    # admission ignores the free room: the window can be over-allocated
    "overallocate": ("admit.lua", "(mode == 'all' and (fr < 0 or by_bound))", "(false)"),
    # a call of a turn that is no longer open is accepted (a second owner of a turn)
    "owner": (
        "_common.lua",
        "  fail('TURNLOST', 'turn ' .. tok .. ' is not open' .. why)\nend",
        "  return true\nend",
    ),
}


def plant(name: str) -> None:
    """Patch ``ledger.scripts.source`` so the named defect is in the scripts it returns."""
    target, old, new = PLANTS[name]
    original = ledger_scripts.source

    def patched(script: str) -> str:
        text = original(script)
        if target == "_common.lua" or script + ".lua" == target:
            if old not in text and target != "_common.lua":
                raise RuntimeError(f"plant {name}: {old!r} not in {target}")
            text = text.replace(old, new)
        return text

    if old not in (ledger_scripts.lua_dir() / target).read_text():
        raise RuntimeError(f"plant {name}: {old!r} not in {target}")
    ledger_scripts.source = patched  # type: ignore[assignment]


def plain(value: Any) -> Any:
    """A result as JSON: dataclasses to dicts, enums to their values, tuples to lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


class Recorder:
    def __init__(self, path: Path, name: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.name = name
        self.n = 0

    def line(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def call(
        self, led: Ledger, op: str, sid: str, call: Call[Any], args: dict[str, Any]
    ) -> tuple[bool | None, Any]:
        """Send ``call`` and record it: (True, result), (False, error) or (None, error)."""
        self.n += 1
        op_id = call.args[0]
        self.line(
            {"k": "inv", "p": self.name, "n": self.n, "op": op, "sid": sid, "id": op_id,
             "a": args, "t": time.time()}
        )  # fmt: skip
        ret: dict[str, Any] = {"k": "ret", "p": self.name, "n": self.n}
        try:
            result = led.run(call)
        except BackendUnavailable as exc:
            self.line({**ret, "ok": None, "e": type(exc).__name__, "t": time.time()})
            return None, exc
        except LedgerError as exc:
            self.line({**ret, "ok": False, "e": type(exc).__name__, "t": time.time()})
            return False, exc
        self.line({**ret, "ok": True, "r": plain(result), "t": time.time()})
        return True, result


def main(config_path: str, name: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    if cfg.get("plant"):
        plant(cfg["plant"])
    warnings.simplefilter("ignore")  # drift warnings: the prompts here are not real
    rng = random.Random(zlib.crc32(f"{cfg['seed']}:{name}".encode()))
    out = Path(cfg["dir"])
    rec = Recorder(out / f"{name}.jsonl", name)
    stop = out / "stop"
    settings = LedgerSettings(
        redis_url=cfg["url"],
        prefix=cfg["prefix"],
        turn_lease_ms=cfg["lease_ms"],
        replica_acks=cfg.get("replica_acks", 0),
        drift_action="warn",
        retry_max_seconds=cfg.get("retry_max_seconds", 10.0),
    )
    dup = cfg.get("dup_rate", 0.15)
    mine: dict[str, list[str]] = {sid: [] for sid in cfg["sessions"]}  # items I committed
    with Ledger.from_settings(settings) as led:
        handles: dict[str, Session] = {}
        k, last_free = 0, 0

        def send(
            op: str, sid: str, call: Call[Any], args: dict[str, Any]
        ) -> tuple[bool | None, Any]:
            nonlocal last_free
            got = rec.call(led, op, sid, call, args)
            if got[0] and isinstance(getattr(got[1], "free", None), int):
                last_free = got[1].free
            if rng.random() < dup:  # a duplicate delivery: the same op id again
                rec.call(led, op, sid, call, args)
            return got

        while not stop.exists():
            sid = rng.choice(cfg["sessions"])
            try:
                s = handles.get(sid) or handles.setdefault(sid, led.session(sid, owner=name))
            except LedgerError as exc:  # (not a call of the history: a read to attach)
                print(f"{time.time():.3f} attach {sid}: {exc!r}"[:300], flush=True)
                time.sleep(0.05)
                continue
            ok, began = send("begin_turn", sid, s.begin_turn_call(100), {"working_set": 100})
            if ok is not True:
                if isinstance(began, StaleEpoch):
                    handles.pop(sid, None)
                time.sleep(rng.uniform(0.0, 0.03))
                continue
            turn = began.turn
            added: list[str] = []
            for _ in range(rng.randint(1, 4)):
                k += 1
                x = rng.random()
                if x < 0.45:
                    item = f"{name}.i{k}"
                    tokens = rng.randint(20, 400)
                    call = s.admit_call(WM, [Item(item, tokens)], turn=turn)
                    ok, _ = send("admit", sid, call, {"item": item, "tokens": tokens, "turn": turn})
                    if ok:
                        added.append(item)
                elif x < 0.65 and mine[sid]:
                    item = mine[sid].pop(rng.randrange(len(mine[sid])))
                    call = s.release_call(WM, [item], turn=turn)
                    send("release", sid, call, {"item": item, "turn": turn})
                else:
                    rid = f"{name}.r{k}"
                    tokens = rng.randint(20, 300)
                    call = s.reserve_call(
                        WM, rid, tokens, lease_ms=cfg["reservation_ms"], turn=turn
                    )
                    ok, _ = send("reserve", sid, call, {"rid": rid, "tokens": tokens, "turn": turn})
                    y = rng.random()
                    if ok and y < 0.5:
                        actual = rng.randint(1, 2 * tokens)
                        call = s.settle_call(rid, actual, turn=turn)
                        ok, _ = send(
                            "settle", sid, call, {"rid": rid, "actual": actual, "turn": turn}
                        )
                        if ok:
                            added.append(rid)
                    elif ok and y < 0.8:
                        send("void", sid, s.void_call(rid, turn=turn), {"rid": rid, "turn": turn})
                    # else: left to expire (the worker's lease sweep)
            if rng.random() < cfg.get("linger_rate", 0.05):
                time.sleep(cfg["lease_ms"] / 1000 * 1.5)  # a slow turn: its lease lapses
            # the prompt's size: the occupancy the last reply implies (drift is not checked)
            prompt = max(1, cfg["window"] - last_free)
            ok, _ = send("end_turn", sid, s.end_turn_call(turn, prompt), {"turn": turn})
            if ok:
                mine[sid].extend(added)
    os.close(rec.fd)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

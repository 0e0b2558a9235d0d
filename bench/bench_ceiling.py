"""Tenant ceilings under a fleet: the ledger's scopes against a check-then-increment
baseline, in one run, both sides interleaved.

    python -m bench.bench_ceiling [--procs 32] [--sessions 200] [--tenants 4]
                                  [--seconds 16] [--window-ms 4000] [--rounds 101]
                                  [--calls 100] [--timing-only] [--json]

It starts its own redis-server. Each of ``--procs`` OS processes loops over model calls
of random sessions of its tenant, alternating the two sides call by call: reserve the
call's worst case (prompt plus output reserve), wait a few ms (the model call), then
settle with billed usage less than reserved (most calls), more than reserved (one in
ten), void (one in ten, the call failed), or stop dead (the parent kills a random process
with SIGKILL about every 0.8 s and starts another: what it held is never settled).

(a) the ledger: ``reserve(cost=...)`` holds the worst case in the session, the tenant and
    a key within it in one script; settle bills, void gives back, a dead process's holds
    lapse on Redis's clock (its lease).
(b) the baseline, written here as LiteLLM's proxy is described in its issues: per scope
    (tenant, then key), one at a time, read spend and reserved, check ``spend + reserved
    + worst <= ceiling``, then INCRBY reserved, with compensating DECRBYs when a later scope
    refuses; settle DECRBYs reserved and INCRBYs spend; the window is reset by the first
    caller that sees it over (SET spend 0, reserved 0): a check and its increment, and a
    reset and a concurrent increment, can interleave.

Overshoot, per tenant and window, is what a side let through past the ceiling, not
counting what calls billed past their own reservation (reported on its own line: a
provider can bill more than the estimate; the ledger charges it and says so). For the
ledger, per bucket of the tenant scope: billed - billed past holds - ceiling; for the
baseline, per window it counted the spend in: the same, from the bench's own tally
written in the MULTI of each baseline settle. Summed over windows and tenants, both in
tokens (input + output) and cents.

Then, the server time of a reserve (INFO commandstats, EVALSHA usec per call) without
and with the tenant scope, interleaved over ``--rounds`` rounds of ``--calls`` calls each
(the phases of a round back to back, their order rotated from round to round). The ratio
printed is the median of the rounds' ratios: each round compares phases a few ms apart, so
a burst of load from elsewhere on the machine moves a round, not the median; the middle
half of the rounds' ratios is printed with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import time
import uuid
from typing import Any

import redis

from bench.common import emit, interleaved, phase_usec
from ledger import (
    CallCost,
    CeilingReached,
    Consumer,
    Ledger,
    LedgerError,
    LedgerSettings,
    Price,
    ScopeBudget,
    SessionBudget,
    Usage,
)
from ledger.testing import standalone

W = Consumer.WORKING_MEMORY
PRICE = Price(300, 1_500)  # cents per million tokens: input, output
SESSION = SessionBudget(window=100_000_000, system_prompt=10)
# Per tenant and window: even tenants are held by their token ceiling (input + output),
# odd ones by their money ceiling (cents); the other ceiling is out of reach.
TIGHT_TOKENS, TIGHT_CENTS, LOOSE = 40_000, 20, 10**6


def ceilings(tenant_index: int) -> tuple[int, int]:
    """(tokens, cents) of tenant i."""
    return (TIGHT_TOKENS, LOOSE) if tenant_index % 2 == 0 else (LOOSE * 100, TIGHT_CENTS)


KEY_FACTOR = 10  # a key's ceilings: 10x its tenant's (never the binding one here)
LEASE_MS = 2_000


def cost_cents_micro(inp: int, out: int) -> int:
    return inp * PRICE.input + out * PRICE.output


# --- the baseline: check then increment, scope by scope -------------------------------


class Baseline:
    """Per scope: spend, reserved and the window's start, in plain keys."""

    def __init__(self, r: redis.Redis, prefix: str, window_ms: int) -> None:
        self.r, self.p, self.window_ms = r, prefix, window_ms

    def _k(self, scope: str, what: str) -> str:
        return f"{self.p}:{scope}:{what}"

    def _roll(self, scope: str, now_ms: int) -> None:
        start = int(self.r.get(self._k(scope, "start")) or 0)
        cur = now_ms - now_ms % self.window_ms
        if start < cur:  # the first caller to see the window over resets it
            self.r.set(self._k(scope, "spend_t"), 0)
            self.r.set(self._k(scope, "spend_m"), 0)
            self.r.set(self._k(scope, "res_t"), 0)
            self.r.set(self._k(scope, "res_m"), 0)
            self.r.set(self._k(scope, "start"), cur)

    def reserve(self, scopes: list[tuple[str, int, int]], tok: int, money: int) -> bool:
        now_ms = int(time.time() * 1000)
        done: list[str] = []
        for scope, cap_t, cap_m in scopes:
            self._roll(scope, now_ms)
            st, sm, rt, rm = (
                int(v or 0)
                for v in self.r.mget(
                    self._k(scope, "spend_t"),
                    self._k(scope, "spend_m"),
                    self._k(scope, "res_t"),
                    self._k(scope, "res_m"),
                )
            )
            if st + rt + tok > cap_t or sm + rm + money > cap_m:
                for d in done:  # compensating releases
                    self.r.decrby(self._k(d, "res_t"), tok)
                    self.r.decrby(self._k(d, "res_m"), money)
                return False
            self.r.incrby(self._k(scope, "res_t"), tok)
            self.r.incrby(self._k(scope, "res_m"), money)
            done.append(scope)
        return True

    def settle(
        self, scopes: list[str], tenant: str, tok: int, money: int, b_tok: int, b_money: int
    ) -> None:
        """Release the reservation and count the billed spend (and, for the bench only,
        its tally of what was billed and billed past the reservation, per window)."""
        now_ms = int(time.time() * 1000)
        window = now_ms - now_ms % self.window_ms
        pipe = self.r.pipeline(transaction=True)
        for scope in scopes:
            pipe.decrby(self._k(scope, "res_t"), tok)
            pipe.decrby(self._k(scope, "res_m"), money)
            pipe.incrby(self._k(scope, "spend_t"), b_tok)
            pipe.incrby(self._k(scope, "spend_m"), b_money)
        truth = f"{self.p}:truth:{tenant}"
        pipe.hincrby(truth, f"{window}:t", b_tok)
        pipe.hincrby(truth, f"{window}:m", b_money)
        pipe.hincrby(truth, f"{window}:xt", max(b_tok - tok, 0))
        pipe.hincrby(truth, f"{window}:xm", max(b_money - money, 0))
        pipe.execute()

    def void(self, scopes: list[str], tok: int, money: int) -> None:
        for scope in scopes:
            self.r.decrby(self._k(scope, "res_t"), tok)
            self.r.decrby(self._k(scope, "res_m"), money)


# --- one process of the fleet -----------------------------------------------------------


def child(url: str, prefix: str, window_ms: int, tenants: list[str], per: int, seed: int) -> None:
    rnd = random.Random(seed)
    settings = LedgerSettings(redis_url=url, prefix=prefix)
    led = Ledger.from_settings(settings)
    base = Baseline(redis.Redis.from_url(url), f"{prefix}:bl", window_ms)
    ti = seed % len(tenants)
    tenant = tenants[ti]
    cap_t, cap_c = ceilings(ti)
    base.r.incr(f"{prefix}:ready")
    sessions = {}
    n = 0
    while True:
        n += 1
        j = rnd.randrange(per)
        key = f"{tenant}/k{j % 2}"
        inp, out = rnd.randint(500, 3_000), rnd.randint(100, 1_000)
        fate = rnd.random()
        if fate < 0.1:  # billed more than reserved
            b_in, b_out = inp + rnd.randint(1, 200), out + rnd.randint(1, 100)
        else:
            b_in, b_out = inp - rnd.randint(0, inp // 4), rnd.randint(1, out)
        money, b_money = cost_cents_micro(inp, out), cost_cents_micro(b_in, b_out)
        side = "ledger" if n % 2 else "baseline"
        if side == "ledger":
            sid = f"@{tenant}/s{j}"
            s = sessions.get(sid) or led.session(sid)
            sessions[sid] = s
            rid = f"{os.getpid()}-{n}"
            try:
                res = s.reserve(
                    W,
                    rid,
                    1,
                    lease_ms=LEASE_MS,
                    cost=CallCost(model="m", input=inp, output=out, scopes=(key,)),
                )
            except CeilingReached:
                time.sleep(0.002)
                continue
            time.sleep(rnd.uniform(0.001, 0.006))  # the model call
            try:
                if fate < 0.8:
                    s.settle(rid, 1, billed=Usage(input=b_in, output=b_out), scopes=res.scopes)
                elif fate < 0.9:
                    s.void(rid, scopes=res.scopes)
            except LedgerError:
                pass  # (an expiry under load: the hold lapsed, nothing billed)
        else:
            scopes = [
                (tenant, cap_t, cap_c * 1_000_000),
                (key, cap_t * KEY_FACTOR, cap_c * KEY_FACTOR * 1_000_000),
            ]
            if not base.reserve(scopes, inp + out, money):
                time.sleep(0.002)
                continue
            time.sleep(rnd.uniform(0.001, 0.006))
            names = [tenant, key]
            if fate < 0.8:
                base.settle(names, tenant, inp + out, money, b_in + b_out, b_money)
            elif fate < 0.9:
                base.void(names, inp + out, money)


# --- the run ------------------------------------------------------------------------------


def overshoot(per_window: dict[int, dict[str, int]], ti: int) -> tuple[int, int, int, int]:
    """(tokens, micro-cents) tenant i let through past its ceilings, and billed past
    reservations."""
    cap_t, cap_c = ceilings(ti)
    tok = mon = xt = xm = 0
    for v in per_window.values():
        tok += max(v.get("t", 0) - v.get("xt", 0) - cap_t, 0)
        mon += max(v.get("m", 0) - v.get("xm", 0) - cap_c * 1_000_000, 0)
        xt, xm = xt + v.get("xt", 0), xm + v.get("xm", 0)
    return tok, mon, xt, xm


def server_time(url: str, prefix: str, tenant: str, rounds: int, calls: int) -> dict[str, Any]:
    """EVALSHA usec per reserve, without and with the tenant scope, interleaved."""
    r = redis.Redis.from_url(url)
    led = Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix))
    # a tenant of the fleet's shape (token and money ceilings, a price table), never full
    big = ScopeBudget(window_ms=86_400_000, tokens=10**12, counted=("input", "output"),
                      cents=10**8, prices={"m": PRICE})  # fmt: skip
    led.set_scope(tenant, big)
    led.set_scope(f"{tenant}/k0", dataclasses.replace(big, prices={}))  # the tenant's prices
    s = led.open_session(f"@{tenant}/timing", SESSION)
    n = [0]

    def phase(cost: CallCost | None) -> float:
        """Server usec per reserve over `calls` reserves; their voids are not timed."""
        held: list[Any] = []

        def body() -> None:
            for _ in range(calls):
                n[0] += 1
                held.append(s.reserve(W, f"t{n[0]}", 1, lease_ms=LEASE_MS, cost=cost))

        usec = phase_usec(r, body)
        for h in held:
            s.void(h.id, scopes=h.scopes)
        return usec

    scoped = CallCost(model="m", input=1_000, output=500)
    keyed = CallCost(model="m", input=1_000, output=500, scopes=(f"{tenant}/k0",))
    got = interleaved(
        rounds, {"plain": lambda: phase(None), "tenant": lambda: phase(scoped),
                 "tenant_key": lambda: phase(keyed)}
    )  # fmt: skip
    res, res_t = got["plain"], got["tenant"]
    led.close()
    ratios = sorted(a / b for a, b in zip(res_t, res, strict=True))
    return {
        "reserve_usec": statistics.median(res),
        "reserve_tenant_usec": statistics.median(res_t),
        "ratio": statistics.median(ratios),
        "ratio_of_medians": statistics.median(res_t) / statistics.median(res),
        "ratios": ratios,
        "middle_half": (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]),
        "best_usec": min(res),
        "best_tenant_usec": min(res_t),
        "best_ratio": min(res_t) / min(res),
        "reserve_tenant_key_usec": statistics.median(got["tenant_key"]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"bc{uuid.uuid4().hex[:6]}"
    with standalone() as srv:
        url = srv.url
        if args.timing_only:  # (the server time alone: to compare releases, one after another)
            return {"timing": server_time(url, prefix, "timing", args.rounds, args.calls)}
        tenants = [f"tenant{i}" for i in range(args.tenants)]
        per = args.sessions // args.tenants
        with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
            for ti, t in enumerate(tenants):
                cap_t, cap_c = ceilings(ti)
                led.set_scope(
                    t,
                    ScopeBudget(
                        window_ms=args.window_ms,
                        tokens=cap_t,
                        counted=("input", "output"),
                        cents=cap_c,
                        prices={"m": PRICE},
                        hold_limit_ms=10_000,
                    ),
                )
                for k in range(2):
                    led.set_scope(
                        f"{t}/k{k}",
                        ScopeBudget(
                            window_ms=args.window_ms,
                            tokens=cap_t * KEY_FACTOR,
                            counted=("input", "output"),
                            hold_limit_ms=10_000,
                        ),
                    )
                for j in range(per):
                    led.open_session(f"@{t}/s{j}", SESSION)
        ctx = mp.get_context("spawn")
        seed = [0]

        def start() -> Any:
            seed[0] += 1
            p = ctx.Process(
                target=child, args=(url, prefix, args.window_ms, tenants, per, seed[0]), daemon=True
            )
            p.start()
            return p

        procs = [start() for _ in range(args.procs)]
        r = redis.Redis.from_url(url)
        deadline = time.time() + 120
        while int(r.get(f"{prefix}:ready") or 0) < args.procs and time.time() < deadline:
            time.sleep(0.1)  # (the spawned interpreters import the ledger)
        rnd = random.Random(7)
        stop = time.time() + args.seconds
        kills = 0
        while time.time() < stop:
            time.sleep(0.8)
            i = rnd.randrange(len(procs))
            os.kill(procs[i].pid, signal.SIGKILL)
            procs[i].join()
            kills += 1
            procs[i] = start()
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
        time.sleep(LEASE_MS / 1000 + 0.2)  # what the dead held lapses

        led = Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix))
        ledger_over = [0, 0, 0, 0]
        base_over = [0, 0, 0, 0]
        windows = 0
        for ti, t in enumerate(tenants):
            u = led.scope_usage(t)
            per_w = {
                b: {
                    "t": v.get("input", 0) + v.get("output", 0),
                    "m": v.get("money", 0),
                    "xt": v.get("over", 0),
                    "xm": v.get("over_money", 0),
                }
                for b, v in u.buckets.items()
            }
            windows += len(per_w)
            ledger_over = [a + b for a, b in zip(ledger_over, overshoot(per_w, ti), strict=True)]
            raw = r.hgetall(f"{prefix}:bl:truth:{t}")
            bw: dict[int, dict[str, int]] = {}
            for k, v in raw.items():
                w, _, q = k.decode().partition(":")
                bw.setdefault(int(w), {})[q] = int(v)
            base_over = [a + b for a, b in zip(base_over, overshoot(bw, ti), strict=True)]
        led.close()
        timing = server_time(url, prefix, "timing", args.rounds, args.calls)
    return {
        "params": vars(args),
        "kills": kills,
        "windows": windows,
        "ledger": {"tokens": ledger_over[0], "cents": ledger_over[1] / 1e6,
                   "billed_past_tokens": ledger_over[2], "billed_past_cents": ledger_over[3] / 1e6},
        "baseline": {"tokens": base_over[0], "cents": base_over[1] / 1e6,
                     "billed_past_tokens": base_over[2], "billed_past_cents": base_over[3] / 1e6},
        "timing": timing,
    }  # fmt: skip


def timing_line(t: dict[str, Any]) -> str:
    return (
        f"reserve server time: {t['reserve_usec']:.1f} us without the tenant scope, "
        f"{t['reserve_tenant_usec']:.1f} us with it: ratio {t['ratio']:.2f} (middle half of "
        f"{len(t['ratios'])} rounds {t['middle_half'][0]:.2f}-{t['middle_half'][1]:.2f}, all "
        f"{min(t['ratios']):.2f}-{max(t['ratios']):.2f}); with the tenant and a key "
        f"{t['reserve_tenant_key_usec']:.1f} us"
    )


def show(res: dict[str, Any]) -> None:
    t = res["timing"]
    if "ledger" not in res:
        print(timing_line(t))
        return
    lo, bo = res["ledger"], res["baseline"]
    print(
        f"overshoot tokens: ledger={lo['tokens']} baseline={bo['tokens']}; "
        f"cents: ledger={lo['cents']:.2f} baseline={bo['cents']:.2f}"
    )
    print(
        f"billed past the reservation (charged and reported, not overshoot): "
        f"ledger={lo['billed_past_tokens']} tokens {lo['billed_past_cents']:.2f} cents; "
        f"baseline={bo['billed_past_tokens']} tokens {bo['billed_past_cents']:.2f} cents"
    )
    print(timing_line(t))
    p = res["params"]
    print(
        f"({p['procs']} processes, {p['sessions']} sessions, {p['tenants']} tenants, "
        f"{p['seconds']} s, {res['windows']} tenant windows, {res['kills']} kill -9)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--procs", type=int, default=32)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=16.0)
    ap.add_argument("--window-ms", type=int, default=4_000)
    ap.add_argument("--rounds", type=int, default=101)
    ap.add_argument("--calls", type=int, default=100, help="reserves a timing phase")
    ap.add_argument("--timing-only", action="store_true", help="the reserve's server time alone")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    emit(run(args), args.json, show)
    return 0


if __name__ == "__main__":
    sys.exit(main())

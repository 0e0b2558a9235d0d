"""Scenario 001's session lengths (docs/demo.md): a lognormal of median 40 and p99 210
turns, the observed distribution, drawn by the seed: the fleet's sessions, and the
sessions of the tail beyond a turn that let a late checkpoint rest on enough sessions."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

MEDIAN_TURNS, P99_TURNS = 40, 210
SIGMA = math.log(P99_TURNS / MEDIAN_TURNS) / NormalDist().inv_cdf(0.99)


def session_lengths(seed: int, n: int, cap: int) -> list[int]:
    """n session lengths drawn from a lognormal of median 40 and p99 210 turns with the
    seed's own random draws, capped at `cap` (and at least 3 turns): two seeds give two
    fleets (other lengths, another total of turns); one seed gives the same fleet."""
    rng = random.Random(f"lengths|{seed}")
    return [
        max(3, min(cap, round(rng.lognormvariate(math.log(MEDIAN_TURNS), SIGMA)))) for _ in range(n)
    ]


def tail_probability(beyond: int) -> float:
    """The share of sessions of the length distribution that outlive `beyond` turns."""
    return 1 - NormalDist().cdf(math.log(beyond / MEDIAN_TURNS) / SIGMA)


def tail_lengths(seed: int, n: int, beyond: int, cap: int) -> list[int]:
    """n session lengths drawn, with the seed's own random draws, from the same
    lognormal's tail beyond `beyond` turns (the distribution conditioned on outliving
    it), capped: the sessions that let a late checkpoint rest on n samples (about 6% of
    a fleet outlives turn 120). Most of them outlive the cap too, and sit at it
    (:func:`tail_probability`: of the sessions past 120 turns, 80% pass 130)."""
    rng = random.Random(f"tail|{seed}")
    p0 = 1 - tail_probability(beyond)
    out = []
    for _ in range(n):
        z = NormalDist().inv_cdf(p0 + (1 - p0) * rng.random())
        out.append(max(beyond, min(cap, round(MEDIAN_TURNS * math.exp(SIGMA * z)))))
    return out

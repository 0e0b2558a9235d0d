"""`bench.bench_turn --against` with the server's cost counted in instructions, not time.

    python -m bench.turn_instructions --against 033c8b3 [--rounds 3] [--calls 200] [--warmup 4]

On a machine shared with other load, a phase's server time moves by a factor of two from
one round to the next; the instructions Redis executes for it do not. This runs the same
phases and rows as `python -m bench.bench_turn --against <commit> --procs 0` on a
redis-server under valgrind's callgrind (`bench.instructions.callgrind_server`, about fifty
times slower), counting inside Redis's `processCommand` (every command a client sends, a
script's own commands inside its script's count), each phase alone. The unit, kinstr, is
thousands of instructions.

The first rounds count several times what the later ones do: the hashes they write are
still small, kept as listpacks (up to 128 fields), where each field written is found by a
scan (with `hash-max-listpack-entries 0` the floor's first rounds count what its later ones
do). So `--warmup` rounds run uncounted: the figures are those of hashes past 128 fields,
a session past its first ten turns or so.

Instructions are not time: a floor that copies 9 KB of texts costs few instructions and
many cache misses, so a ratio to the floor is far higher here than in time; compare
scripts with scripts, and read the time figures of `bench.bench_turn` beside these.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import redis

from bench.bench_turn import Meter, against
from bench.instructions import callgrind_server


class Instructions(Meter):
    """Thousands of instructions inside `processCommand` since the last `start`."""

    unit = "kinstr"

    def __init__(self, r: redis.Redis, count: Callable[[], float]) -> None:
        super().__init__(r)
        self.count = count

    def start(self) -> None:
        self.count()

    def stop(self, names: list[str]) -> float:
        return self.count() / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--against", required=True, help="a commit: its turn beside this tree's")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=4, help="rounds not counted (see above)")
    a = ap.parse_args()
    a.procs = 0
    with callgrind_server("processCommand") as (r, count):
        port = r.connection_pool.connection_kwargs["port"]
        print(f"{'figure':<44} {'this tree':>10} {'reference':>10}  ratio (min-max)")
        for line in against(f"redis://127.0.0.1:{port}", a, Instructions(r, count)):
            print(line, flush=True)


if __name__ == "__main__":
    main()

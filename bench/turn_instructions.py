"""`bench.bench_turn --against` with the server's cost counted in instructions, not time.

    python -m bench.turn_instructions --against 033c8b3 [--rounds 3] [--calls 200] [--warmup 4]

On a machine shared with other load, a phase's server time moves by a factor of two from
one round to the next; the instructions Redis executes for it do not. This runs the same
phases and rows as `python -m bench.bench_turn --against <commit> --procs 0` on a
redis-server started under valgrind's callgrind (about fifty times slower), counting only
inside Redis's `processCommand` (every command a client sends, a script's own commands
inside its script's count), zeroed before each phase and dumped after it
(`callgrind_control`). The unit, kinstr, is thousands of instructions. The first rounds
count several times what the later ones do (seen on every run here; the cause was not
looked into), so `--warmup` rounds run uncounted. Needs valgrind (Debian's package
`valgrind`). Instructions are not time: a floor that copies 9 KB of texts costs few
instructions and many cache misses, so a ratio to the floor is far higher here than in
time; compare scripts with scripts, and read the time figures of `bench.bench_turn`
beside these.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from bench.bench_turn import Meter, against
from ledger.testing import free_port


class Instructions(Meter):
    """Thousands of instructions inside `call` since the last `start`."""

    unit = "kinstr"

    def __init__(self, r: redis.Redis, pid: int, out: Path) -> None:
        super().__init__(r)
        self.pid, self.out = pid, out

    def _control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(self.pid)], check=True,
                       capture_output=True)  # fmt: skip

    def start(self) -> None:
        self._control("-z")

    def stop(self, names: list[str]) -> float:
        before = set(self.out.glob("cg.*"))
        self._control("-d")
        (dump,) = set(self.out.glob("cg.*")) - before
        m = re.search(r"^totals: (\d+)", dump.read_text(errors="replace"), re.M)
        assert m, f"no totals in {dump}"
        dump.unlink()
        return int(m.group(1)) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--against", required=True, help="a commit: its turn beside this tree's")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=4, help="rounds not counted (see above)")
    a = ap.parse_args()
    a.procs = 0
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="bench-cg-") as d:
        port = free_port()
        p = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/cg.%p",
             "--collect-atstart=no", "--toggle-collect=processCommand", "redis-server", "--port",
             str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", d],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            r = redis.Redis(port=port)
            for _ in range(300):
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.1)
            meter = Instructions(r, p.pid, Path(d))
            print(f"{'figure':<44} {'this tree':>10} {'reference':>10}  ratio (min-max)")
            for line in against(f"redis://127.0.0.1:{port}", a, meter):
                print(line, flush=True)
        finally:
            p.terminate()
            p.wait(timeout=60)


if __name__ == "__main__":
    main()

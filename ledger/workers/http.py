"""The worker's HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` and ``/readyz``;
and the container's health probe, ``python -m ledger.workers.http [healthz|readyz]``,
which asks the endpoint on the port and address the worker's settings name
(``LEDGER_WORKER_METRICS_PORT``, ``LEDGER_WORKER_METRICS_HOST``): exit 0 on 200, 1
otherwise, the answer's reason printed.

``/healthz`` answers 200 while the job loop keeps turning and 503 once it has not turned
for ``stale_s`` seconds (a wedged loop: a probe that restarts the container then helps);
``/readyz`` answers 200 only when the loop is healthy, has started and Redis answered its
last pass. Anything else is 404. Served by a thread of its own, so it answers while the
loop is busy, but it reads the loop's own heartbeat, so it does not say "healthy" for a
loop that stopped.
"""

from __future__ import annotations

import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:  # (the probe, python -m ledger.workers.http, imports no more)
    from ledger.workers.metrics import Metrics


class Served(Protocol):
    """What the endpoint reads of a worker: its metrics, and its health."""

    @property
    def metrics(self) -> Metrics: ...

    def health(self, stale_s: float) -> tuple[bool, bool, str]: ...


def serve(worker: Served, port: int, stale_s: float, host: str = "") -> ThreadingHTTPServer:
    """Start the endpoint on ``port`` (0: a free one; see ``server_address``) in a daemon
    thread; ``shutdown()`` then ``server_close()`` stop it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # (the name http.server calls)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(worker.metrics.registry), CONTENT_TYPE_LATEST)
                return
            if path in ("/healthz", "/readyz"):
                healthy, ready, why = worker.health(stale_s)
                ok = healthy if path == "/healthz" else ready
                self._send(200 if ok else 503, (why + "\n").encode(), "text/plain")
                return
            self._send(404, b"not found: /metrics, /healthz, /readyz\n", "text/plain")

        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # the worker logs JSON lines; probes every few seconds would drown them

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ledger-worker-http", daemon=True).start()
    return server


def probe(path: str = "healthz", timeout: float = 3.0) -> int:
    """Ask this host's worker endpoint (from the worker's settings): 0 when it answers
    200, 1 otherwise (no port set, refused, 503); prints the reason it gives."""
    from ledger.workers.settings import WorkerSettings

    s = WorkerSettings(compactor="none")
    if not s.metrics_port:
        print("no metrics port: LEDGER_WORKER_METRICS_PORT is not set", file=sys.stderr)
        return 1
    host = "127.0.0.1" if s.metrics_host in ("", "0.0.0.0") else s.metrics_host
    host = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{host}:{s.metrics_port}/{path}", timeout=timeout) as r:
            print(r.read().decode().strip())
            return 0
    except urllib.error.HTTPError as e:
        print(e.read().decode().strip(), file=sys.stderr)
    except OSError as e:
        print(f"no answer on {host}:{s.metrics_port}: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(probe("readyz" if sys.argv[1:2] == ["readyz"] else "healthz"))

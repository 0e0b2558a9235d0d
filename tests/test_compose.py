"""docker-compose.yml and the Dockerfile, checked without Docker.

The structure is read with yaml.safe_load and compared with what the project
needs. The Redis commands themselves are run on this machine's redis-server, and
the cluster's one-shot init script is run for real against three local nodes
(the service names are mapped to 127.0.0.1 and free ports by stand-ins for
`getent` and `redis-cli` on PATH), so a typo in an option or the script fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from ledger import LedgerSettings, cli
from ledger.backends import parse_url
from tests.support import servers

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_NODES = ["redis-cluster-1", "redis-cluster-2", "redis-cluster-3"]
CLUSTER_PORTS = {"redis-cluster-1": 7001, "redis-cluster-2": 7002, "redis-cluster-3": 7003}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    svc = compose["services"]
    assert isinstance(svc, dict)
    return svc


def argv(command: str | list[str]) -> list[str]:
    """A compose command as an argv list (compose splits a string like a shell)."""
    return command.split() if isinstance(command, str) else [str(a) for a in command]


def option(args: list[str], name: str) -> str:
    """The value after `--name` in a redis-server argv."""
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def interpolate(text: str) -> str:
    """Compose's interpolation for a file that uses no variables: '$$' is a literal '$'
    and any other '$' would be substituted (so it must not occur)."""
    bare = re.sub(r"\$\$", "", text)
    assert "$" not in bare, f"unescaped '$' would be interpolated by compose: {text!r}"
    return text.replace("$$", "$")


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per Dockerfile instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def instructions(name: str) -> list[str]:
    return [rest for word, rest in dockerfile() if word == name]


# Service keys of the Compose Specification this file may use: a misspelt key
# ("depend_on") would be refused by `docker compose`, so it is refused here.
SERVICE_KEYS = {
    "build",
    "command",
    "container_name",
    "depends_on",
    "entrypoint",
    "environment",
    "extra_hosts",
    "healthcheck",
    "image",
    "init",
    "ports",
    "profiles",
    "restart",
    "stop_grace_period",
    "stop_signal",
    "volumes",
}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "start_interval"}


def test_only_compose_spec_keys(compose: dict[str, Any]) -> None:
    assert set(compose) <= {"name", "services", "volumes", "networks"} | {
        k for k in compose if k.startswith("x-")
    }
    for name, svc in compose["services"].items():
        assert re.fullmatch(r"[a-zA-Z0-9._-]+", name)
        assert set(svc) <= SERVICE_KEYS, (name, set(svc) - SERVICE_KEYS)
        assert set(svc.get("healthcheck", {})) <= HEALTHCHECK_KEYS, name
        assert isinstance(svc.get("restart", "no"), str), "unquoted no is a YAML bool"
        for port in svc.get("ports", []):
            assert isinstance(port, str), f"{name}: quote ports (YAML reads 6379:6379 as base 60)"
        for key, value in svc.get("environment", {}).items():
            assert isinstance(value, str), (name, key)
        for dep in svc.get("depends_on", {}):
            assert dep in compose["services"], (name, dep)
        for volume in svc.get("volumes", []):
            assert volume.split(":", 1)[0] in compose["volumes"], (name, volume)


# --- the default profile: redis + worker ----------------------------------------------


def test_default_profile_is_redis_and_the_worker(services: dict[str, dict[str, Any]]) -> None:
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert default == {"redis", "worker"}


def test_redis_service(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    r = services["redis"]
    assert r["image"] == "redis:7.2"
    args = argv(r["command"])
    assert args[0] == "redis-server"
    assert option(args, "--appendonly") == "yes"
    assert option(args, "--appendfsync") == "everysec"
    assert "127.0.0.1:6379:6379" in [str(p) for p in r["ports"]]
    assert option(args, "--maxmemory-policy") == "noeviction"
    assert option(args, "--maxmemory") == "1gb"
    volume, _, target = r["volumes"][0].partition(":")
    assert target == "/data"
    assert volume in compose["volumes"], "redis data must live on a named volume"
    test = r["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL") and "redis-cli" in " ".join(test)
    assert "ping" in " ".join(test)


def test_worker_service(services: dict[str, dict[str, Any]]) -> None:
    w = services["worker"]
    assert w["build"]["context"] == "."
    assert (ROOT / w["build"].get("dockerfile", "Dockerfile")).is_file()
    assert argv(w["command"]) == ["ledger", "worker"]
    assert w["environment"]["LEDGER_REDIS_URL"] == "redis://redis:6379/0"
    assert w["depends_on"] == {"redis": {"condition": "service_healthy"}}


def test_worker_command_is_the_cli_worker(services: dict[str, dict[str, Any]]) -> None:
    """`ledger` is the package's console script and `worker` one of its subcommands."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cmd = argv(services["worker"]["command"])
    assert project["scripts"][cmd[0]] == "ledger.cli:main"
    parsed = cli.build_parser().parse_args(cmd[1:])
    assert parsed.func is cli.cmd_worker


@pytest.mark.parametrize("service", ["worker", "worker-cluster"])
def test_worker_url_is_read_by_the_settings(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, service: str
) -> None:
    env = services[service]["environment"]
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    url = LedgerSettings().redis_url
    assert url == env["LEDGER_REDIS_URL"]
    host = url.split("://", 1)[1].split(":", 1)[0]
    kind = parse_url(url).kind
    assert host in services, f"{url} names no service"
    assert kind == ("cluster" if service == "worker-cluster" else "standalone")


# --- the cluster profile ----------------------------------------------------------------


def test_cluster_profile(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    in_profile = {n for n, s in services.items() if "cluster" in s.get("profiles", [])}
    assert {*CLUSTER_NODES, "redis-cluster-init"} <= in_profile
    primaries = [n for n in in_profile if "--cluster-enabled" in argv(services[n]["command"])]
    assert sorted(primaries) == CLUSTER_NODES
    volumes = set()
    for name in CLUSTER_NODES:
        node, port = services[name], CLUSTER_PORTS[name]
        args = argv(node["command"])
        assert node["image"] == "redis:7.2"
        assert args[0] == "redis-server"
        assert option(args, "--port") == str(port)
        assert option(args, "--cluster-enabled") == "yes"
        assert option(args, "--cluster-config-file") == "nodes.conf"
        assert option(args, "--cluster-announce-hostname") == name
        assert option(args, "--cluster-preferred-endpoint-type") == "hostname"
        assert option(args, "--appendonly") == "yes"
        assert f"127.0.0.1:{port}:{port}" in [str(p) for p in node["ports"]]
        assert option(args, "--maxmemory-policy") == "noeviction"
        volume, _, target = node["volumes"][0].partition(":")
        assert target == "/data" and volume in compose["volumes"]
        volumes.add(volume)
        assert str(port) in " ".join(node["healthcheck"]["test"])
    assert len(volumes) == 3, "each node keeps its own nodes.conf and data"


def test_cluster_init_service(services: dict[str, dict[str, Any]]) -> None:
    init = services["redis-cluster-init"]
    assert init["image"] == "redis:7.2"
    assert init["restart"] == "no"
    assert init["depends_on"] == {n: {"condition": "service_healthy"} for n in CLUSTER_NODES}
    script = interpolate(" ".join([*argv(init["entrypoint"]), init["command"][0]]))
    assert "redis-cli --cluster create" in script
    assert "--cluster-replicas 0" in script
    assert "--cluster-yes" in script
    assert "getent hosts" in script, "CLUSTER MEET takes IPs: the names must be resolved"
    wc = services["worker-cluster"]
    assert wc["depends_on"] == {
        "redis-cluster-init": {"condition": "service_completed_successfully"}
    }
    assert argv(wc["command"]) == argv(services["worker"]["command"])


# --- the Dockerfile ---------------------------------------------------------------------


def test_dockerfile_base_image_and_command(services: dict[str, dict[str, Any]]) -> None:
    # a patch release on a named Debian release: a rebuild months later gets the same Python
    assert instructions("FROM") == ["python:3.11.9-slim-bookworm"]
    cmd = instructions("CMD")
    assert len(cmd) == 1
    assert json.loads(cmd[0]) == argv(services["worker"]["command"])
    assert any(
        re.search(r"\bpip install (-c constraints\.txt )?\"?\.(\[[a-z,-]+\])?\"?(\s|$)", run)
        for run in instructions("RUN")
    )
    env = " ".join(instructions("ENV"))
    assert "LEDGER_REDIS_URL" not in env  # no Redis baked in: the deployment names it
    assert "LEDGER_WORKER_METRICS_PORT=9464" in env and instructions("EXPOSE") == ["9464"]
    (check,) = instructions("HEALTHCHECK")  # the job loop's heartbeat, as compose probes it
    probe = services["worker"]["healthcheck"]["test"]
    assert ["CMD", *json.loads(check.partition("CMD")[2])] == probe


# `pip install [-c constraints.txt] ".[extras]"`
PIP_EXTRAS = r"\bpip install (?:-c constraints\.txt )?\"?\.\[([a-z,-]+)\]\"?(\s|$)"


def installed_extras() -> set[str]:
    """The extras of the Dockerfile's `pip install ".[...]"`."""
    found = [m.group(1) for run in instructions("RUN") if (m := re.search(PIP_EXTRAS, run))]
    assert len(found) == 1, found
    return set(found[0].split(","))


def requirements(extras: set[str]) -> set[str]:
    """The distributions the package's core and ``extras`` name, extras of extras too."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional: dict[str, list[str]] = project["optional-dependencies"]
    names, todo, seen = set(), list(extras), set()
    for req in project["dependencies"]:
        names.add(re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower())
    while todo:
        extra = todo.pop()
        assert extra in optional, f"the Dockerfile installs an unknown extra {extra!r}"
        seen.add(extra)
        for req in optional[extra]:
            name = re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower()
            if name == project["name"]:  # "redis-token-ledger[tokenizer]"
                todo += set(req.partition("[")[2].partition("]")[0].split(",")) - seen
            else:
                names.add(name)
    return names


def test_dockerfile_installs_what_the_worker_needs(services: dict[str, dict[str, Any]]) -> None:
    """The image runs `ledger worker` (its metrics: the `worker` extra) with the compactor
    compose names (ledger.adapters.summarizer: httpx and a tokenizer, the `summarizer`
    extra), the admin commands' output (``ledger audit`` / ``top`` / ``inspect`` in the
    container: the `cli` extra), and nothing else."""
    for name in ("worker", "worker-cluster"):
        compactor = services[name]["environment"]["LEDGER_WORKER_COMPACTOR"]
        assert compactor.split(":")[0] == "ledger.adapters.summarizer", compactor
    names = requirements(installed_extras())
    assert {"prometheus-client", "httpx", "tiktoken", "redis", "rich"} <= names, names
    assert not names & {"fakeredis", "matplotlib"}, names  # embedded, plot


def test_dockerfile_installs_with_every_dependency_pinned() -> None:
    """The image installs with deploy/constraints.txt (``-c``): every distribution its
    extras name is pinned there (==), so two builds of one commit get the same versions."""
    lock = ROOT / "deploy" / "constraints.txt"
    assert ("COPY", "deploy/constraints.txt ./") in [(i, rest.strip()) for i, rest in dockerfile()]
    pinned = {}
    for line in lock.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[0-9][0-9A-Za-z.+-]*", version), line
            pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
    needed = {re.sub(r"[-_.]+", "-", n) for n in requirements(installed_extras())}
    assert needed <= set(pinned), needed - set(pinned)


@pytest.mark.slow
def test_dockerfile_copies_enough_to_build_the_wheel(tmp_path: Path) -> None:
    """The image is built from the COPY'd files only: they must make the whole wheel."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for rest in instructions("COPY"):
        *sources, _dest = rest.split()
        for src in sources:
            path = ROOT / src
            if path.is_dir():
                shutil.copytree(path, ctx / src, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                (ctx / src).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, ctx / src)
    out = tmp_path / "dist"
    # With build isolation, as pip in the image does: the backend comes from the index.
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ctx)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ledger/cli/__init__.py", "ledger/workers/runner.py", "ledger/lua/_common.lua"} <= names


# --- the commands, run on this machine's redis-server ----------------------------------


def node_extra(command: str | list[str]) -> list[str]:
    """A compose redis-server argv without the binary and its --port (ours is free)."""
    args = argv(command)[1:]
    if "--port" in args:
        i = args.index("--port")
        del args[i : i + 2]
    return args


@pytest.mark.redis
def test_redis_command_runs(services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    extra = node_extra(services["redis"]["command"])
    node = servers.RedisProcess(servers.free_port(), tmp_path, extra).start()
    try:
        r = redis.Redis(port=node.port, decode_responses=True)
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert int(r.config_get("maxmemory")["maxmemory"]) == 1024**3
        r.close()
    finally:
        node.stop()


def _stand_ins(bin_dir: Path, ports: dict[int, int]) -> dict[str, str]:
    """`getent` and `redis-cli` that map the compose service names and ports to ours."""
    bin_dir.mkdir()
    real_cli = servers.require_binary("redis-cli")
    getent = bin_dir / "getent"
    getent.write_text('#!/bin/sh\n[ "$1" = hosts ] && echo "127.0.0.1       $2"\n')
    cli_py = bin_dir / "redis-cli"
    cli_py.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"PORTS = {{str(k): str(v) for k, v in {ports!r}.items()}}\n"
        "out = []\n"
        "for a in sys.argv[1:]:\n"
        "    if a.startswith('redis-cluster-'):\n"
        "        a = '127.0.0.1'\n"
        "    elif a in PORTS:\n"
        "        a = PORTS[a]\n"
        "    elif a.rpartition(':')[2] in PORTS:\n"
        "        h, _, p = a.rpartition(':')\n"
        "        a = h + ':' + PORTS[p]\n"
        "    out.append(a)\n"
        f"os.execv({real_cli!r}, [{real_cli!r}, *out])\n"
    )
    for f in (getent, cli_py):
        f.chmod(f.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture
def compose_cluster(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> Iterator[list[servers.RedisProcess]]:
    """The three cluster nodes, started with their compose commands on free ports."""
    nodes: list[servers.RedisProcess] = []
    try:
        for name in CLUSTER_NODES:
            d = tmp_path / name
            d.mkdir()
            extra = node_extra(services[name]["command"])
            nodes.append(servers.RedisProcess(servers.free_port(bus=True), d, extra).start())
        yield nodes
    finally:
        for n in nodes:
            n.stop()


@pytest.mark.redis
@pytest.mark.cluster
def test_cluster_init_script_creates_the_cluster_once(
    services: dict[str, dict[str, Any]],
    compose_cluster: list[servers.RedisProcess],
    tmp_path: Path,
) -> None:
    ports = {
        CLUSTER_PORTS[n]: node.port for n, node in zip(CLUSTER_NODES, compose_cluster, strict=True)
    }
    env = _stand_ins(tmp_path / "bin", ports)
    init = services["redis-cluster-init"]
    cmd = [*argv(init["entrypoint"]), interpolate(init["command"][0])]

    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "cluster ready" in first.stdout
    for node in compose_cluster:
        r = redis.Redis(port=node.port, decode_responses=True)
        info = r.cluster("info")
        assert info["cluster_state"] == "ok"
        assert int(info["cluster_slots_assigned"]) == 16384
        assert int(info["cluster_known_nodes"]) == 3
        assert int(info["cluster_size"]) == 3  # three primaries, each with slots
        r.close()

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already created" in again.stdout


def test_the_worker_is_probed_on_its_health_endpoint(services: dict[str, dict[str, Any]]) -> None:
    """The worker's healthcheck asks /healthz on its metrics port (the job loop's
    heartbeat, tests/test_worker_lifecycle.py), and the default summarizer host resolves on
    Linux."""
    w = services["worker"]
    # the probe reads the port and address from the worker's settings (its environment)
    assert w["healthcheck"]["test"] == ["CMD", "python", "-m", "ledger.workers.http", "healthz"]
    assert w["environment"]["LEDGER_WORKER_METRICS_PORT"]
    assert "host.docker.internal:host-gateway" in w["extra_hosts"]


def test_nothing_is_published_beyond_the_hosts_loopback(
    services: dict[str, dict[str, Any]],
) -> None:
    """Redis runs without a password here, so every published port (Redis, the cluster
    nodes, the workers' metrics) is bound to 127.0.0.1; both workers have a metrics port
    probed on /healthz."""
    published = {name: [str(p) for p in s.get("ports", [])] for name, s in services.items()}
    assert all(p.startswith("127.0.0.1:") for ports in published.values() for p in ports), published
    ranges = []
    for name in ("worker", "worker-cluster"):
        port = services[name]["environment"]["LEDGER_WORKER_METRICS_PORT"]
        # a range of host ports, so that --scale worker=N does not collide on one
        [spec] = [p for p in published[name] if p.endswith(f":{port}")]
        first, last = (int(x) for x in spec.split(":")[1].split("-"))
        assert last > first
        ranges.append(range(first, last + 1))
        assert "ledger.workers.http" in services[name]["healthcheck"]["test"]
    assert not set(ranges[0]) & set(ranges[1])

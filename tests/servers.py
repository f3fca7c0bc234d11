"""Real servers for the tests of several machines (tests/test_servers.py): a PostgreSQL cluster made with
initdb in a temporary folder and an `mlflow server` process on its database, both on 127.0.0.1 on free
ports, started once per test session (fixtures `postgres` and `mlflow_server` in conftest.py) and stopped
at its end. Where PostgreSQL's binaries are missing the tests skip, naming the command that installs them.
PostgreSQL refuses to run as root: as root the cluster runs as the `postgres` user (`runuser`)."""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

INSTALL = "apt-get install -y postgresql (Debian/Ubuntu; macOS: brew install postgresql@15)"
USER, PASSWORD = "harness", "pg-s3cret-Pw"
"""The tests' database role; the password is looked for in every output (it must be nowhere)."""
ADMIN = "postgres-admin"
"""The cluster's superuser password (role postgres): databases are made with it."""


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin(name: str) -> str | None:
    """A PostgreSQL server binary: on PATH, else where Debian's package puts it."""
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)


@dataclass
class Postgres:
    host: str
    port: int
    data: Path
    as_user: list[str]

    def url(self, db: str, *, password: bool = False, host: str | None = None) -> str:
        secret = f":{PASSWORD}" if password else ""
        return f"postgresql://{USER}{secret}@{host or self.host}:{self.port}/{db}"

    def create_database(self, db: str) -> str:
        """A new, empty database owned by USER; its URL (no password in it)."""
        import psycopg

        with psycopg.connect(f"postgresql://postgres:{ADMIN}@{self.host}:{self.port}/postgres", autocommit=True) as c:
            c.execute(f"CREATE DATABASE {db} OWNER {USER}")
        return self.url(db)


def start_postgres() -> Postgres:
    """initdb + pg_ctl start (fsync off: a test cluster) in a fresh folder of the system's temporary folder
    (pytest's is root's alone, which the postgres user cannot enter), then the role USER and its databases
    optuna and mlflow."""
    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        raise FileNotFoundError(f"PostgreSQL's initdb and pg_ctl are not installed; install them: {INSTALL}")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="harness-pg-"))
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None or subprocess.run(["id", "postgres"], capture_output=True).returncode:
            raise FileNotFoundError(f"as root, PostgreSQL needs a `postgres` user and runuser; install: {INSTALL}")
        as_user = [runuser, "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
    (root / "pw").write_text(f"{ADMIN}\n")
    if as_user:
        shutil.chown(root / "pw", "postgres")
    data, port = root / "data", free_port()
    subprocess.run([*as_user, initdb, "-D", str(data), "-U", "postgres", "--auth=scram-sha-256",
                    f"--pwfile={root / 'pw'}", "-E", "UTF8", "--no-sync"], check=True, capture_output=True)
    subprocess.run([*as_user, pg_ctl, "-D", str(data), "-l", str(root / "server.log"), "-w", "start", "-o",
                    f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c fsync=off -c full_page_writes=off"],
                   check=True, capture_output=True)
    pg = Postgres("127.0.0.1", port, data, as_user)
    import psycopg

    with psycopg.connect(f"postgresql://postgres:{ADMIN}@127.0.0.1:{port}/postgres", autocommit=True) as c:
        c.execute(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'")
    for db in ("optuna", "mlflow"):
        pg.create_database(db)
    return pg


def stop_postgres(pg: Postgres) -> None:
    subprocess.run([*pg.as_user, pg_bin("pg_ctl"), "-D", str(pg.data), "-m", "immediate", "stop"], capture_output=True)
    shutil.rmtree(pg.data.parent, ignore_errors=True)


@dataclass
class MlflowServer:
    uri: str
    proc: subprocess.Popen
    log: Path


def start_mlflow_server(pg: Postgres, root: Path, timeout_s: float = 180) -> MlflowServer:
    """The documented command (docs/SCALING.md): `mlflow server --backend-store-uri postgresql://...` with the
    password in PGPASSWORD, artifacts served from a folder; waits until /health answers."""
    port, log = free_port(), root / "mlflow-server.log"
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", pg.url("mlflow"),
           "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    # MLflow's job runner off (huey consumers for its GenAI jobs; no request here makes a job): four more
    # processes that each import MLflow, ~28 s of CPU in the half minute after the server is up
    env = {**os.environ, "PGPASSWORD": PASSWORD, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                return MlflowServer(uri, proc, log)
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_mlflow_server(MlflowServer(uri, proc, log))
            raise RuntimeError(f"mlflow server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_mlflow_server(server: MlflowServer) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()

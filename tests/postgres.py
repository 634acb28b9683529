"""A throwaway PostgreSQL cluster for tests, set up as infra/docker-compose.yml sets up Prefect's database: user
and database ``prefect``, password authentication, reached over TCP on loopback.

The cluster lives in a temporary directory (its data, its log, its Unix socket) on a free port, and is stopped
and deleted when the block ends, however it ends. The server binaries are Debian's ``postgresql`` package
(``make postgres`` installs it where we are root with apt-get); PostgreSQL refuses to run as root, so a root
test process runs the cluster as the package's ``postgres`` user.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from server.launcher import free_port

# Debian keeps the server's binaries (initdb, pg_ctl) off PATH, under one directory per major version
DEBIAN_BINARIES = Path("/usr/lib/postgresql")


def binaries() -> Path | None:
    """The directory of initdb and pg_ctl: PATH's, else Debian's newest version; None where neither exists."""
    on_path = shutil.which("pg_ctl")
    if on_path is not None and shutil.which("initdb") is not None:
        return Path(on_path).resolve().parent
    found = [p for p in DEBIAN_BINARIES.glob("*/bin") if (p / "initdb").exists() and p.parent.name.isdigit()]
    return max(found, key=lambda p: int(p.parent.name)) if found else None


def _run_as() -> list[str]:
    """The command prefix that runs the cluster's programs: as ``postgres`` when we are root."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    if binaries() is None:
        return "no PostgreSQL server (initdb, pg_ctl): `make postgres` installs Debian's (as root, with apt-get)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user to run the cluster as"
    return None


@contextlib.contextmanager
def postgres_cluster() -> Iterator[str]:
    """A running cluster with database ``prefect``; yields its SQLAlchemy URL for Prefect
    (``postgresql+asyncpg://prefect:<password>@127.0.0.1:<port>/prefect``)."""
    bin_dir, run_as = binaries(), _run_as()
    assert bin_dir is not None, unavailable()
    # Prefect's Postgres driver is in the dev extras, so `make test` has it: its absence is a failure
    assert importlib.util.find_spec("asyncpg") is not None, "asyncpg is not installed: pip install -e '.[dev]'"
    # not under pytest's temporary directory, which only its owner can enter
    root = Path(tempfile.mkdtemp(prefix="sidecar-pg-"))
    data, log, password_file = root / "data", root / "server.log", root / "password"
    password, port = secrets.token_hex(16), free_port()
    password_file.write_text(password)
    if run_as:
        owner = pwd.getpwnam("postgres")
        for path in (root, password_file):
            os.chown(path, owner.pw_uid, owner.pw_gid)

    def run(*command: str | Path) -> None:
        done = subprocess.run([*run_as, *map(str, command)], cwd=root, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command[0]} failed: {done.stdout}{done.stderr}{_tail(log)}"

    try:
        run(bin_dir / "initdb", "-D", data, "-U", "prefect", "--pwfile", password_file, "--auth", "scram-sha-256",
            "-E", "UTF8", "--no-sync")
        run(bin_dir / "pg_ctl", "-D", data, "-l", log, "-w", "-t", "60", "start", "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1")
        done = subprocess.run([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect",
                               "prefect"], env=os.environ | {"PGPASSWORD": password}, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, f"createdb failed: {done.stderr}"
        yield f"postgresql+asyncpg://prefect:{password}@127.0.0.1:{port}/prefect"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], cwd=root,
                           capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""

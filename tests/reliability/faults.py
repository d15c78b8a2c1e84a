"""Services a test may break on purpose: a private Redis server, a private PostgreSQL cluster,
and a TCP proxy that takes an endpoint (S3) down and brings it back on the same port.

The machine's shared Postgres and Redis are never restarted or flushed: the fault tests get
their own, so nothing else on the machine notices.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import redis

from devstack.services import ServiceUnavailableError, free_port, wait_for


class PrivateRedis:
    """A redis-server of our own (no persistence, like the machine's): flush it or restart it."""

    def __init__(self, log_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceUnavailableError("redis-server is not installed (make services).")
        self.binary, self.port = binary, free_port()
        self.log = log_dir / f"redis-{self.port}.log"
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--logfile", str(self.log)]  # fmt: skip
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self.client().ping(), 20, f"redis-server on port {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=5)

    def flushall(self) -> None:
        with self.client() as client:
            client.flushall()

    def restart(self, down_s: float = 1.0) -> None:
        """Kill the server (every connection drops, every message is gone), start it again."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class PrivatePostgres:
    """A throwaway PostgreSQL cluster (initdb) on a free port, which a test can restart."""

    def __init__(self) -> None:
        self.bin = _pg_bin()
        # Not under pytest's tmp_path: that is private to root, and as root PostgreSQL must run
        # as the postgres user, who needs to reach its data directory.
        root = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
        self.root, self.port = root, free_port()
        self.data = root / "pgdata"
        self.log = root / "postgres.log"
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            shutil.chown(root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.start()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def _options(self) -> str:
        return (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=200")  # fmt: skip

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-o", self._options(), "-l", str(self.log),
                  "-w", "start")  # fmt: skip

    def restart(self) -> None:
        """A fast shutdown (every session is terminated) and a start: a real restart."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        time.sleep(1.0)
        self.start()

    def answers(self) -> bool:
        try:
            with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres",
                                 connect_timeout=1) as conn:  # fmt: skip
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


def _pg_bin() -> Path:
    root = Path("/usr/lib/postgresql")
    versions = sorted(root.glob("*/bin/initdb")) if root.exists() else []
    if not versions:
        found = shutil.which("initdb")
        if found is None:
            raise ServiceUnavailableError("PostgreSQL's initdb is not installed.")
        return Path(found).parent
    return versions[-1].parent


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; `down()` drops every connection and refuses new
    ones until `up()`, as an endpoint that went away and came back."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for conn in conns:
            _close(conn)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()

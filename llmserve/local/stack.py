"""The whole stack as OS processes: Valkey (unless a Redis URL is given), then
tokenizer_svc, batcher, gpu_worker ×N and gateway ×M, each started as
`python -m <service>` so an operator can see and signal it.

Used by `llmserve up` and by the end-to-end and fault tests:

    stack = Stack(StackConfig(workers=2)).start()   # returns once every service is SERVING
    stack.gateway_target                            # "127.0.0.1:50051"
    stack.kill("gpu_worker-0")                      # kill -9, for fault tests
    stack.stop()                                    # SIGTERM in dependency order

Children run in the caller's working directory (relative paths given to `up` mean what they
mean there) with Python's safe-path mode (`-P`: that directory is not put on sys.path, so no
folder in it can shadow a package) and find the packages where this process found llmserve.
"""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

import llmserve
from llmserve.catalog import model_store, routes
from llmserve.catalog.models_file import ModelsConfig, ServedModel, from_specs, load_models_file
from llmserve.local.valkey import ValkeyServer
from llmserve.runtime import redis_client

logger = structlog.get_logger(__name__)

# The directory llmserve was imported from (a checkout, site-packages, a `pip install --target` dir).
# `up`'s state, under the directory it was started in: logs and port files (logs/), the Valkey
# AOF (valkey/), and the Redis URL it started or was given (redis-url), for admin commands run there.
STATE_DIR = Path(".llmserve")
PACKAGE_ROOT = Path(llmserve.__file__).resolve().parent.parent
DEFAULT_TENANTS = Path(llmserve.__file__).resolve().parent / "tenants.dev.yaml"   # ships in the wheel
# LLMSERVE_* variables the children inherit: the model cache, and the queue cell count that
# gateways, batchers and workers must agree on. Other LLMSERVE_* settings go by flags.
_PASSED_ENV = ("LLMSERVE_CACHE_DIR", "LLMSERVE_QUEUE_SHARDS")
# Order in which services stop: the front door first, so nothing new arrives.
STOP_ORDER = ("gateway", "batcher", "gpu_worker", "tokenizer_svc")


@dataclass
class StackConfig:
    model: str = model_store.DEFAULT_MODEL
    workers: int = 1
    models_file: Path | None = None   # versions and aliases (llmserve/catalog/models_file.py); then model/workers are unused
    gateways: int = 1
    device: str = "auto"
    quantization: str = ""            # worker weight format (--quantization); "" = the worker's default
    drain_timeout_s: float | None = None   # how long a draining worker finishes sequences before handing
                                           # the rest over (--drain-timeout-s); None = the worker's default
    port: int = 50051                 # first gateway's port; 0 = a free one
    http_port: int = 0                # first gateway's OpenAI-compatible HTTP port; 0 = off, -1 = a free one
    tenants: Path = DEFAULT_TENANTS
    redis_url: str | None = None      # None: start a Valkey server
    redis_appendonly: bool = False    # the started Valkey keeps an AOF (llmserve up: always)
    redis_fsync: str = "everysec"     # its appendfsync: everysec | always (docs/durability.md)
    redis_dir: Path | None = None     # where its AOF goes; None: log_dir/valkey
    log_dir: Path | None = None       # None: a temp dir
    host: str = "127.0.0.1"
    start_timeout_s: float = 300.0
    # extra flags per service name, e.g. {"batcher": ["--max-wait-ms", "5"]}
    extra_flags: dict[str, list[str]] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)


class ServiceProcess:
    """One `python -m <module>` child with its log file and the port it bound.

    The child binds `port_request` (0 = any free port) and writes the port it got to its port
    file; `port` reads it from there. Its Prometheus metrics listen on a free port too, written
    to `metrics_port_path` (NAME.metrics.port next to the log) for scrapers. A sticky service
    (tokenizer_svc, gateway: others hold their address) asks for the same port again when it is
    started anew.
    """

    def __init__(self, name: str, module: str, flags: list[str], port_request: int, log_path: Path,
                 env: dict[str, str] | None, sticky_port: bool = False) -> None:
        self.name = name
        self.module = module
        self.flags = flags
        self.port_request = port_request
        self.log_path = log_path
        self.port_path = log_path.with_suffix(".port")
        self.metrics_port_path = log_path.with_suffix(".metrics.port")
        self.env = env
        self.sticky_port = sticky_port
        self.process: subprocess.Popen | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        return self._port if self._port is not None else self.wait_port(time.monotonic() + 300.0)

    @property
    def popen(self) -> subprocess.Popen:
        """The running (or exited) child; only after start()."""
        if self.process is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.process

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServiceProcess:
        self.port_path.unlink(missing_ok=True)
        self.metrics_port_path.unlink(missing_ok=True)
        self._port = None
        log = open(self.log_path, "ab")
        argv = [sys.executable, "-P", "-m", self.module, "--port", str(self.port_request),
                "--port-file", str(self.port_path), "--metrics-port", "-1",
                "--metrics-port-file", str(self.metrics_port_path), *self.flags]
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = _with_package_root(env.get("PYTHONPATH", ""))
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def alive(self) -> bool:
        """Running; asking reaps an exited child."""
        return self.process is not None and self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.returncode if self.process else None

    def wait_port(self, deadline: float) -> int:
        """Block until the child has bound its port; raise if it dies or time runs out."""
        while self._port is None:
            text = self.port_path.read_text() if self.port_path.exists() else ""
            if text.strip():
                self._port = int(text)
                if self.sticky_port:
                    self.port_request = self._port
                return self._port
            self._check_running(deadline, "bound no port")
            time.sleep(0.05)
        return self._port

    def wait_serving(self, deadline: float) -> None:
        """Block until grpc.health.v1 says SERVING; raise if the process dies or time runs out."""
        self.wait_port(deadline)
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_running(deadline, "not SERVING")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)

    def _check_running(self, deadline: float, what: str) -> None:
        if not self.alive():
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; log: {self.log_path}\n"
                               f"{self.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{self.name} {what} in time; log: {self.log_path}\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait for a graceful exit, SIGKILL when it does not come."""
        if not self.alive():
            return self.process.returncode if self.process else None
        self.signal(signal.SIGTERM)
        code = self.wait(timeout_s)
        if code is None:
            self.popen.kill()
            code = self.popen.wait()
        return code

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class Stack:
    """Start, inspect and stop the whole stack."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self._tmp: tempfile.TemporaryDirectory | None = None
        log_dir = config.log_dir
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="llmserve-stack-")
            log_dir = Path(self._tmp.name)
        self.log_dir = Path(log_dir).resolve()   # every path a child gets is absolute
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.valkey: ValkeyServer | None = None
        self.redis_url = config.redis_url or ""
        self.services: dict[str, ServiceProcess] = {}
        self.models: ModelsConfig = load_models_file(config.models_file) if config.models_file else \
            from_specs([config.model], config.workers)
        self.model_path = model_store.resolve(self.models.models[0].spec)
        self.model_id = self.models.ids[0]
        self.worker_models: dict[str, str] = {}   # worker name -> the concrete model id it serves
        self._worker_seq = 0
        self._gateway_seq = 0

    # -- targets ---------------------------------------------------------------------------------------
    @property
    def gateway_targets(self) -> list[str]:
        return [s.target for n, s in self.services.items() if n.startswith("gateway-")]

    @property
    def gateway_target(self) -> str:
        return self.gateway_targets[0]

    @property
    def tokenizer_target(self) -> str:
        return self.services["tokenizer_svc"].target

    @property
    def queue_shards(self) -> int:
        """The queue cells per model the services run with (llmserve/protocol/keys.py)."""
        return int(self._env().get("LLMSERVE_QUEUE_SHARDS", "1"))

    def named(self, prefix: str) -> list[ServiceProcess]:
        return [s for n, s in self.services.items() if n.startswith(prefix)]

    def workers_of(self, model_id: str) -> list[ServiceProcess]:
        """The worker processes serving the concrete model `model_id`."""
        return [self.services[n] for n, m in self.worker_models.items() if m == model_id]

    def _models_flag(self, plain: str) -> str:
        """A service's --models: the models file itself when there is one, else `plain`."""
        return f"@{Path(self.config.models_file).resolve()}" if self.config.models_file else plain

    # -- start -----------------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        """The children's environment; the Redis URL (it may hold a password) travels here, never in argv."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_") or k in _PASSED_ENV}
        env["REDIS_URL"] = self.redis_url
        env.update(self.config.extra_env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _service(self, name: str, module: str, flags: list[str], port: int = 0,
                 sticky_port: bool = False) -> ServiceProcess:
        extra = self.config.extra_flags.get(module, [])
        proc = ServiceProcess(name, module, ["--host", self.config.host, *flags, *extra], port,
                              self.log_dir / f"{name}.log", self._env(), sticky_port)
        self.services[name] = proc
        return proc.start()

    def start_tokenizer(self) -> ServiceProcess:
        return self._service("tokenizer_svc", "tokenizer_svc", ["--models", self._models_flag(str(self.config.model))],
                             sticky_port=True)

    def start_batcher(self, name: str = "batcher") -> ServiceProcess:
        return self._service(name, "batcher", ["--models", self._models_flag(self.model_id)])

    def start_worker(self, model: ServedModel | None = None) -> ServiceProcess:
        """One more worker of `model` (default: the first model)."""
        model = model or self.models.models[0]
        name = f"gpu_worker-{self._worker_seq}"
        self._worker_seq += 1
        self.worker_models[name] = model.id
        spec = str(self.config.model) if not self.config.models_file else model.spec
        flags = ["--model", spec, "--device", self.config.device, "--worker-id", name]
        if self.config.quantization:
            flags += ["--quantization", self.config.quantization]
        if self.config.drain_timeout_s is not None:
            flags += ["--drain-timeout-s", str(self.config.drain_timeout_s)]
        return self._service(name, "gpu_worker", flags)

    def start_gateway(self, port: int = 0) -> ServiceProcess:
        name = f"gateway-{self._gateway_seq}"
        self._gateway_seq += 1
        flags = ["--tenants", str(Path(self.config.tenants).resolve()), "--tokenizer-target", self.tokenizer_target,
                 "--models", self._models_flag(str(self.config.model))]
        if self.config.http_port and name == "gateway-0":
            flags += ["--http-port", str(self.config.http_port), "--http-port-file", str(self._http_port_file(name))]
        return self._service(name, "gateway", flags, port, sticky_port=True)

    def _http_port_file(self, gateway: str) -> Path:
        return self.log_dir / f"{gateway}.http.port"

    @property
    def http_url(self) -> str:
        """Base URL of the first gateway's OpenAI-compatible endpoint (StackConfig.http_port set)."""
        path = self._http_port_file("gateway-0")
        deadline = time.monotonic() + 60
        while not (path.exists() and path.read_text().strip()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no HTTP port reported in {path}")
            time.sleep(0.05)
        return f"http://127.0.0.1:{int(path.read_text())}"

    def start(self) -> Stack:
        """Start everything and return once every service reports SERVING."""
        deadline = time.monotonic() + self.config.start_timeout_s
        try:
            if not self.redis_url:
                self.valkey = self._valkey().start()
                self.redis_url = self.valkey.url
            self.seed_routes()
            tokenizer = self.start_tokenizer()
            batcher = self.start_batcher()
            workers = [self.start_worker(m) for m in self.models.models for _ in range(m.workers)]
            for proc in (tokenizer, batcher, *workers):
                proc.wait_serving(deadline)
            for i in range(self.config.gateways):
                self.start_gateway(self.config.port if i == 0 else 0).wait_serving(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _valkey(self) -> ValkeyServer:
        if not self.config.redis_appendonly:
            return ValkeyServer(log_path=self.log_dir / "valkey.log")
        data_dir = self.config.redis_dir or self.log_dir / "valkey"
        return ValkeyServer(data_dir=data_dir, appendfsync=self.config.redis_fsync, log_path=self.log_dir / "valkey.log")

    def seed_routes(self) -> None:
        """The models file's alias weights into Redis, over any earlier `llmserve route`: an `up`
        starts from its file (gateways started later only seed aliases that have no weights)."""
        client = redis_client.connect_sync(self.redis_url)
        try:
            routes.seed(client, self.models, overwrite=True)
        finally:
            client.close()

    # -- faults and stop -------------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """kill -9 one service."""
        proc = self.services[name]
        if proc.alive():
            proc.popen.kill()
            proc.popen.wait()

    def retire(self, name: str) -> int | None:
        """Stop one service gracefully and forget it; returns its exit code."""
        return self.services.pop(name).stop()

    def stop(self) -> dict[str, int | None]:
        """Stop every service gracefully (front door first), then Valkey. Returns exit codes."""
        codes: dict[str, int | None] = {}
        for prefix in STOP_ORDER:
            for proc in self.named(prefix):
                codes[proc.name] = proc.stop()
        if self.valkey:
            self.valkey.close()
            self.valkey = None
        return codes

    def close(self) -> None:
        self.stop()
        if self._tmp:
            self._tmp.cleanup()


def _with_package_root(pythonpath: str) -> str:
    """PYTHONPATH with the directory llmserve came from first, unless Python finds it anyway (a
    site directory), so a child imports the very code its parent runs."""
    if str(PACKAGE_ROOT) in {*site.getsitepackages(), site.getusersitepackages()}:
        return pythonpath
    return os.pathsep.join([str(PACKAGE_ROOT), *filter(None, pythonpath.split(os.pathsep))])

"""Typed settings: one dataclass per service, read once at start-up.

Every field can be set by a command-line flag (`--max-batch 8`) or an env var
(`LLMSERVE_MAX_BATCH=8`); a flag wins over the environment, the environment over
the default. Values are converted to the field's type and checked by the
dataclass's `validate()`; any problem raises `SettingsError` naming the setting.

    @dataclass
    class BatcherSettings(CommonSettings):
        max_batch: int = setting(32, "sequences per batch")

        def validate(self) -> None:
            super().validate()
            require(self.max_batch >= 1, "max_batch", "must be >= 1")
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

ENV_PREFIX = "LLMSERVE_"
T = TypeVar("T", bound="BaseSettings")


class SettingsError(ValueError):
    """A setting has a value the service cannot start with."""


def setting(default: Any, help: str, *, secret: bool = False, env: str | None = None) -> Any:
    """Declare a settings field with its help text (and an extra env var name)."""
    return field(default=default, metadata={"help": help, "secret": secret, "env": env})


def require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise SettingsError(f"invalid setting {name}: {why}")


def _base_type(tp: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of an annotation."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _convert(name: str, raw: str, tp: type, optional: bool) -> Any:
    if optional and raw.strip().lower() in ("", "none"):
        return None
    try:
        if tp is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return tp(raw)
    except ValueError:
        raise SettingsError(f"invalid setting {name}: {raw!r} is not a valid {tp.__name__}") from None


@dataclass
class BaseSettings:
    """Base of every service's settings; subclasses add fields and checks."""

    def validate(self) -> None:
        """Raise SettingsError when a value is out of range; subclasses extend."""

    @classmethod
    def env_name(cls, f: dataclasses.Field) -> str:
        return ENV_PREFIX + f.name.upper()

    @classmethod
    def flag_name(cls, f: dataclasses.Field) -> str:
        return "--" + f.name.replace("_", "-")

    @classmethod
    def parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=description)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, _ = _base_type(hints[f.name])
            help_text = f"{f.metadata.get('help', '')} (env {cls.env_name(f)}; default {f.default!r})"
            kind = "BOOL" if tp is bool else tp.__name__.upper()
            parser.add_argument(cls.flag_name(f), dest=f.name, default=None, metavar=kind, help=help_text)
        return parser

    @classmethod
    def load(
        cls: type[T],
        argv: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        prog: str = "llmserve",
        description: str = "",
    ) -> T:
        """Build and validate settings from flags, then env, then defaults."""
        env = os.environ if env is None else env
        args = cls.parser(prog, description).parse_args(list(argv or []))
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            tp, optional = _base_type(hints[f.name])
            raw = getattr(args, f.name)
            if raw is None:
                raw = env.get(cls.env_name(f))
            if raw is None and f.metadata.get("env"):
                raw = env.get(f.metadata["env"])
            if raw is not None:
                values[f.name] = _convert(f.name, raw, tp, optional)
        settings = cls(**values)
        settings.validate()
        return settings

    @classmethod
    def load_or_exit(cls: type[T], argv: Sequence[str] | None, prog: str, description: str = "") -> T:
        """`load()` for a service's `main`: a bad setting ends the process with exit code 2 and the
        reason on stderr, as a bad flag does."""
        try:
            return cls.load(argv, prog=prog, description=description)
        except SettingsError as exc:
            cls.parser(prog, description).error(str(exc))

    def to_flags(self) -> list[str]:
        """The command-line flags that reproduce these settings."""
        flags: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                flags += [self.flag_name(f), str(value).lower() if isinstance(value, bool) else str(value)]
        return flags

    def redacted(self) -> dict[str, Any]:
        """Settings as a dict for logging, secrets masked."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = "***" if f.metadata.get("secret") and value else value
        return out


@dataclass
class CommonSettings(BaseSettings):
    """Settings every service shares: where it listens, Redis, logging, metrics."""

    host: str = setting("127.0.0.1", "interface the gRPC server binds")
    port: int = setting(0, "gRPC port (0 = the kernel picks a free one at bind time)")
    port_file: str = setting("", "write the bound gRPC port to this file once listening (for supervisors)")
    metrics_port: int = setting(0, "Prometheus metrics HTTP port (0 = off, -1 = a free one)")
    metrics_port_file: str = setting("", "write the bound metrics port to this file once listening (for supervisors)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis/Valkey URL", env="REDIS_URL")
    redis_password: str = setting("", "Redis password (overrides the URL's)", secret=True)
    redis_wait_s: float = setting(120.0, "seconds a service started before Redis is reachable waits for it "
                                         "(jittered backoff, each attempt logged) before it exits")
    log_level: str = setting("info", "debug, info, warning or error")
    grace_s: float = setting(10.0, "seconds to finish in-flight work on SIGTERM")
    tls_cert: str = setting("", "PEM certificate file; with tls_key turns on TLS (re-read when the file changes)")
    tls_key: str = setting("", "PEM private key file", secret=False)
    reflection: bool = setting(True, "serve gRPC server reflection (turn it off on a public port)")
    health_port: int = setting(0, "extra plaintext port serving grpc.health.v1 only, for probes that cannot "
                                  "speak TLS (kubelet); 0 = none")
    queue_shards: int = setting(1, "independent queue cells per model, each in its own Redis Cluster slot "
                                   "(gateways, batchers and workers must agree; see llmserve/protocol/keys.py)")

    def validate(self) -> None:
        super().validate()
        require(0 <= self.port < 65536, "port", "must be in 0..65535")
        require(-1 <= self.metrics_port < 65536, "metrics_port", "must be in -1..65535")
        require(0 <= self.health_port < 65536, "health_port", "must be in 0..65535")
        require(self.log_level in ("debug", "info", "warning", "error"), "log_level",
                "must be debug, info, warning or error")
        require(self.grace_s >= 0, "grace_s", "must be >= 0")
        require(self.redis_wait_s >= 0, "redis_wait_s", "must be >= 0")
        require(1 <= self.queue_shards <= 1024, "queue_shards", "must be in 1..1024")
        require(self.redis_url.startswith(("redis://", "rediss://", "unix://")), "redis_url",
                "must start with redis://, rediss:// or unix://")
        require(bool(self.tls_cert) == bool(self.tls_key), "tls_cert",
                "tls_cert and tls_key must be given together")

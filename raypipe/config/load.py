"""The config's layers, read and merged: a file, the environment, overrides; and a run's input."""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from raypipe.config.sections import InputConfig, PipelineConfig
from raypipe.errors import ConfigError

ENV_PREFIX = "RAYPIPE_"


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        elif value is not None:
            out[key] = value
    return out


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _datadog_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """The Datadog agent's standard variables, as the lowest layer of `metrics`."""
    metrics = {
        key: environ[var]
        for key, var in (("dogstatsd_host", "DD_AGENT_HOST"), ("dogstatsd_port", "DD_DOGSTATSD_PORT"))
        if environ.get(var)
    }
    return {"metrics": metrics} if metrics else {}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at {e.start}): save it as UTF-8"
        ) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top, not {type(data).__name__}")
    return data


def _describe(err: ValidationError) -> str:
    """The errors on one line, each at its dotted path; an unknown key names the nearest valid one."""
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top)"
        if e["type"] == "extra_forbidden":
            near = _nearest_key(e["loc"])
            parts.append(f"{where}: unknown setting" + (f" (did you mean {near}?)" if near else ""))
        else:
            parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def _nearest_key(loc: tuple[int | str, ...]) -> str | None:
    """The valid dotted key closest to an unknown one (`input.unit_row` -> `input.unit_rows`)."""
    model: type[BaseModel] = PipelineConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        inner = _model_of(field.annotation) if field is not None else None
        if inner is None:
            return None
        model = inner
    near = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return ".".join([*(str(p) for p in loc[:-1]), near[0]]) if near else None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The config section an annotation holds (`InputConfig | None` -> `InputConfig`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def load_config(
    file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    offline: bool = False,
) -> PipelineConfig:
    """Builds the run's config from a file, the environment and overrides (in that order).

    `offline` checks a config for another machine (a manifest's entrypoint): files it names,
    such as `service.ca_file`, exist only there, so they are not read.

    Below them all, `DD_AGENT_HOST` and `DD_DOGSTATSD_PORT` in `environ` default the DogStatsD
    address (`metrics.dogstatsd_host`, `metrics.dogstatsd_port`)."""
    merged: dict[str, Any] = _datadog_defaults(environ) if environ is not None else {}
    if file is not None:
        merged = _deep_merge(merged, _read_file(Path(file)))
    if environ is not None:
        merged = _deep_merge(merged, _from_env(environ))
    if overrides:
        merged = _deep_merge(merged, overrides)
    try:
        return PipelineConfig.model_validate(merged, context={"offline": offline})
    except ValidationError as e:
        raise ConfigError("invalid configuration: " + _describe(e)) from e


def run_input(config: PipelineConfig, uri: str | None, mode: str) -> InputConfig:
    """The input of a backfill or a daily: the config's `input` section with `uri` (the run
    call's `input`, the CLI's `--input`) over its uri. Raises `ConfigError` when neither names one.

    The run calls keep the input apart from the rest of the run's config: only the preflight
    and planning read it (`raypipe.api`)."""
    section = config.input
    if uri is not None:
        fields = section.model_dump(exclude_unset=True) if section is not None else {}
        try:
            section = InputConfig(**{**fields, "uri": uri})
        except ValidationError as e:
            raise ConfigError("invalid configuration: input." + _describe(e)) from e
    if section is None or not section.uri:
        raise ConfigError(f"a {mode} needs an input: --input URI (or the setting input.uri)")
    return section

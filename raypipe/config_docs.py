"""`python -m raypipe.config_docs`: the settings tables of docs/configuration.md, written from the
pydantic models of `raypipe.config`; `--check` exits 1, writing nothing, where the page differs.

Each setting's row gives its dotted name, type (with its bounds), default, the environment
variable that sets it and its field docstring, so a field added, renamed, re-defaulted or
re-described in `raypipe.config` shows up as a difference (`tests/unit/test_docs_config.py`
runs the check). The tables sit between `BEGIN` and `END` in the page; the prose around them is
hand-written.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from raypipe.config import PipelineConfig
from raypipe.config.load import ENV_PREFIX

__all__ = ["BEGIN", "END", "Setting", "env_var", "main", "settings", "tables"]

ROOT = Path(__file__).resolve().parent.parent
PAGE = Path("docs") / "configuration.md"
BEGIN = "<!-- settings: `python -m raypipe.config_docs` writes them from raypipe/config/; edits are overwritten -->"
END = "<!-- end of settings -->"


@dataclass(frozen=True)
class Setting:
    """One leaf field of `PipelineConfig`, at its dotted path."""

    path: tuple[str, ...]
    field: FieldInfo

    @property
    def name(self) -> str:
        return ".".join(self.path)


def settings(model: type[BaseModel] = PipelineConfig, prefix: tuple[str, ...] = ()) -> Iterator[Setting]:
    """Every leaf setting under `model`, in declaration order; a section (a nested model) is
    walked, not listed. A map (`metrics.tags`) is one setting whose keys are the user's."""
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            yield from settings(section, (*prefix, name))
        else:
            yield Setting((*prefix, name), field)


def env_var(setting: Setting) -> str | None:
    """The environment variable that sets `setting`, or None: `load_config` reads only
    `RAYPIPE_<SECTION>__<FIELD>` names (with a `__`), so a top-level setting has none. A map
    takes one variable per key (`RAYPIPE_METRICS__TAGS__ENV=prod`; the key is lower-cased)."""
    if len(setting.path) < 2:
        return None
    name = ENV_PREFIX + "__".join(setting.path).upper()
    return name + "__<KEY>" if get_origin(setting.field.annotation) is dict else name


def tables() -> list[str]:
    """The generated block: one table per section, top-level settings first."""
    groups: dict[str, list[Setting]] = {}
    for s in settings():
        groups.setdefault(".".join(s.path[:-1]), []).append(s)
    out: list[str] = []
    for section in [*(g for g in groups if g), *(g for g in groups if not g)]:  # declaration order, top level last
        if section:
            out += [f"### `{section}`", ""]
        else:
            out += [
                "### Top level",
                "",
                "These have no environment variable (`load_config` reads only `RAYPIPE_<SECTION>__<FIELD>`;",
                "a `RAYPIPE_CORE_HOUR_USD` is ignored): set them in the config file, with `--set`",
                "(e.g. `--set core_hour_usd=0.05`) or as an API argument.",
                "",
            ]
        out += ["| Setting | Type | Default | Environment | Meaning |", "|---|---|---|---|---|"]
        for s in groups[section]:
            env = env_var(s)
            out.append(
                f"| `{s.name}` | {_cell(_type(s.field))} | {_cell(_default(s.field))} "
                f"| {f'`{env}`' if env else '–'} | {_cell(_doc(s.field))} |"
            )
        out.append("")
    return out[:-1]


def rewrite(text: str, block: list[str]) -> str:
    """`text` with what lies between its `BEGIN` and `END` lines replaced by `block`."""
    lines = text.split("\n")
    try:
        begin, end = lines.index(BEGIN), lines.index(END)
    except ValueError:
        raise ValueError(f"{PAGE} has no generated block (the lines {BEGIN!r} and {END!r})") from None
    if end < begin:
        raise ValueError(f"{PAGE}: {END!r} comes before {BEGIN!r}")
    return "\n".join([*lines[: begin + 1], *block, *lines[end:]])


def _section(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _type(field: FieldInfo) -> str:
    text = _annotation(field.annotation)
    bounds = []
    for m in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                bounds.append(f"{sign} {getattr(m, attr)}")
    return text + (f", {' and '.join(bounds)}" if bounds else "")


def _annotation(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        inner = [_annotation(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if origin is dict:
        key, value = get_args(annotation)
        return f"map of {_annotation(key)} to {_annotation(value)}"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}" if value >= 10_000 else str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return "empty"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


def _doc(field: FieldInfo) -> str:
    return " ".join((field.description or "").split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raypipe.config_docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page differs from the models; write nothing")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    path = args.root / PAGE
    text = path.read_text(encoding="utf-8")
    new = rewrite(text, tables())
    if new == text:
        return 0
    if args.check:
        print(f"{PAGE}'s settings differ from raypipe/config/: run `python -m raypipe.config_docs`", file=sys.stderr)
        return 1
    path.write_text(new, encoding="utf-8")
    print(f"rewrote the settings of {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

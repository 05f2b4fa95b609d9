"""The command line the docs show is the one that ships: every `raypipe ...` command and flag in
README.md and docs/*.md exists in `raypipe.cli`'s parser, and every command's `--help` shows
its examples (which parse), the exit codes and, for the run commands, the `--set` form."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from raypipe import config_docs
from raypipe.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_BLOCK = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
_CALL = re.compile(r"(?:^|&&|;|\||\$\(|\$|-m|entrypoint:|\b[A-Z_]+=\S+)\s*raypipe\s+(?=[a-z-])(.*)")
"""`raypipe` where a command starts: a line's (or code span's) first word, after a shell separator
or environment assignments, `-m` (`python -m raypipe`) or a manifest's `entrypoint:`; not `kubectl -n raypipe`."""
_PLACEHOLDER = re.compile(r"^[A-Z_]+$|^<.*>$|^\[.*\]$|^\.\.\.$|^…$")


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from _parsers(child)


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def _mentions() -> Iterator[tuple[str, str]]:
    """(where, command line) for each `raypipe ...` in the docs' code spans and code blocks."""
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT).as_posix()
        blocks = [re.sub(r"\\\n\s*", " ", b) for b in _BLOCK.findall(text)]  # join continued lines
        prose = _BLOCK.sub("", text)
        for chunk in [*_SPAN.findall(prose), *(line for b in blocks for line in b.splitlines())]:
            chunk = chunk.split(" #")[0]
            for m in _CALL.finditer(chunk):
                yield name, m.group(1)


def _problems(line: str, root: argparse.ArgumentParser) -> list[str]:
    """What in one `raypipe` command line (the words after `raypipe`) the parser does not know."""
    parser, words, found = root, line.split(), []
    # A line that names one command after another ("raypipe compact, then raypipe vacuum") is cut
    # at the next shell separator.
    words = words[: next((i for i, w in enumerate(words) if w in ("|", "&&", ";", "||")), len(words))]
    i = 0
    while i < len(words):
        word = words[i].strip("`'\",.);:")
        commands = _commands(parser)
        if commands is None or word.startswith("-") or not word:
            break
        choice = word.split("|")  # "quarantine|release"
        if not all(c in commands for c in choice):
            if not _PLACEHOLDER.match(word):
                found.append(f"no command {parser.prog} {word}")
            return found
        parser = commands[choice[0]]
        i += 1
    options = {o for p in (root, parser) for a in p._actions for o in a.option_strings}
    for j, word in enumerate(words[i:], start=i):
        flag = word.strip("`'\"[(,.);:").split("=")[0].rstrip("]")
        if flag.startswith("--") and len(flag) > 2 and flag not in options:
            found.append(f"{parser.prog} has no {flag}")
        if flag == "--set" and j + 1 < len(words):
            key = words[j + 1].strip("`'\"[]").split("=")[0]
            if not _PLACEHOLDER.match(key) and key not in SETTINGS and not key.startswith("metrics.tags."):
                found.append(f"no setting {key}")
    return found


SETTINGS = {s.name for s in config_docs.settings()}
_ENV = re.compile(r"\bRAYPIPE_[A-Z0-9_]*__[A-Z0-9_]+\b")


def test_the_docs_name_raypipe_commands():
    assert len(list(_mentions())) > 30  # the scan sees the docs' commands at all


def test_every_command_and_flag_the_docs_name_exists():
    root = build_parser()
    problems = sorted(
        {f"{where}: `raypipe {line.strip()}`: {p}" for where, line in _mentions() for p in _problems(line, root)}
    )
    assert problems == []


def test_every_setting_variable_the_docs_name_exists():
    known = {config_docs.env_var(s) for s in config_docs.settings()} - {None}
    named = {(path.relative_to(ROOT).as_posix(), v) for path in DOCS for v in _ENV.findall(path.read_text("utf-8"))}
    assert (
        sorted((where, v) for where, v in named if v not in known and not v.startswith("RAYPIPE_METRICS__TAGS__")) == []
    )


#: Flags of other tools that the docs name on their own: `ray job submit`, a cloud's node pool, helm.
FOREIGN_FLAGS = {"--runtime-env-json", "--node-labels", "--crds"}


def test_every_flag_the_docs_name_on_its_own_is_raypipes():
    flags = {o for p in _parsers(build_parser()) for a in p._actions for o in a.option_strings}
    named = {
        (path.relative_to(ROOT).as_posix(), flag)
        for path in DOCS
        for flag in re.findall(r"`(--[a-z][a-z0-9-]*)[^`]*`", _BLOCK.sub("", path.read_text(encoding="utf-8")))
    }
    assert sorted((where, f) for where, f in named if f not in flags | FOREIGN_FLAGS) == []


_SETTING_SPAN = re.compile(
    r"`((?:input|output|service|client|actors|dedup|metrics)\.[a-z_][a-z_.]*[a-z_])(?:[=: ][^`]*)?`"
)


def test_every_setting_the_docs_name_in_a_code_span_exists():
    from protos.telemetry import Catalog
    from raypipe.call.metrics import CATALOG

    assert isinstance(CATALOG, Catalog)
    metrics = {m.name for m in CATALOG.metrics}  # `client.breaker.open` is a metric, not a setting
    sections = {".".join(s.path[:i]) for s in config_docs.settings() for i in range(1, len(s.path))}
    unknown = [
        f"{path.relative_to(ROOT).as_posix()}: {name}"
        for path in DOCS
        for name in _SETTING_SPAN.findall(path.read_text(encoding="utf-8"))
        if name not in SETTINGS | sections | metrics and not name.startswith("metrics.tags.")
    ]
    assert unknown == []


def test_the_check_catches_an_unknown_command_and_flag():
    root = build_parser()
    assert _problems("gc --output s3://b/o", root) == ["no command raypipe gc"]
    assert _problems("backfill --input x --outptu y", root) == ["raypipe backfill has no --outptu"]
    assert _problems("shards quarantine|release --output URI SHARD...", root) == []
    assert _problems("report --output o --run-id r --json", root) == []
    assert _problems("daily --set input.unit_row=5", root) == ["no setting input.unit_row"]


@pytest.mark.parametrize("parser", list(_parsers(build_parser())), ids=lambda p: p.prog)
def test_every_commands_help_shows_examples_and_exit_codes(parser, capsys):
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "\nexamples:\n  raypipe " in text
    assert "\nexit codes:\n  0 " in text and "\n  2    bad configuration" in text
    if parser.prog in ("raypipe", "raypipe backfill", "raypipe daily", "raypipe replay"):
        assert "--set section.key=value" in text and "RAYPIPE_<SECTION>__<FIELD>" in text
        assert "\n  3    " in text and "\n  143  " in text


@pytest.mark.parametrize("parser", list(_parsers(build_parser())), ids=lambda p: p.prog)
def test_every_example_in_the_help_parses(parser):
    root = build_parser()
    examples = (parser.epilog or "").split("examples:\n")[1].split("\n\n")[0].splitlines()
    assert examples
    for example in examples:
        words = shlex.split(example)
        assert words[0] == "raypipe"
        root.parse_args(words[1:])  # an unknown flag or a missing argument exits 2

"""Every link in README.md and docs/*.md reaches a file (and a heading, where it names one), and
every repository file a doc names in a code span exists."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)
_FILE_SPAN = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.(?:md|py|json|yaml|yml|txt|toml|ipynb|proto|sql))`")
_TOP = (
    "README.md",
    "Makefile",
    "bench/",
    "docs/",
    "kuberay/",
    "notebooks/",
    "protos/",
    "raypipe/",
    "serve_app/",
    "tests/",
)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def _broken_links(path: Path) -> list[str]:
    found = []
    for target in _LINK.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            found.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            found.append(f"{target}: no heading #{anchor}")
    return found


def test_every_link_reaches_its_file_and_heading():
    broken = [f"{p.relative_to(ROOT)}: {b}" for p in DOCS for b in _broken_links(p)]
    assert broken == []


#: Files a doc names that live outside the repository: a model directory's, an output's.
OUTSIDE = {"model.json", "config.json", "COMMITTED.json"}


def test_every_repository_file_named_in_a_code_span_exists():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    basenames = {Path(f).name for f in tracked}
    missing = []
    for path in DOCS:
        for name in _FILE_SPAN.findall(path.read_text(encoding="utf-8")):
            if "/" not in name:
                ok = name in basenames or name in OUTSIDE  # a bare name: some file of the repository
            elif name.startswith(_TOP):
                ok = (ROOT / name).exists()
            else:
                continue  # a path of the user's (./model/..., an output's runs/<id>.json)
            if not ok:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []


def test_the_check_sees_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Some heading: here\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#some-heading-here) [bad](docs/a.md) [gone](a.md#nowhere) [web](https://x.y)\n")
    assert _broken_links(page) == ["docs/a.md: no such file", "a.md#nowhere: no heading #nowhere"]


_NUMBERS = {
    w: i
    for i, w in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    )
}


def test_the_number_of_monitors_the_docs_give_is_the_files():
    monitors = json.loads((ROOT / "kuberay" / "datadog" / "monitors.json").read_text(encoding="utf-8"))
    said = [
        (path.relative_to(ROOT).as_posix(), word)
        for path in DOCS
        for word in re.findall(r"\b(\w+) (?:metric )?monitors\b", path.read_text(encoding="utf-8"))
        if word.lower() in _NUMBERS
    ]
    assert said, "no doc says how many monitors ship"
    assert [(where, w) for where, w in said if _NUMBERS[w.lower()] != len(monitors)] == []

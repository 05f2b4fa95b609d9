"""Offline checks of raypipe's Datadog dashboard and monitors against what the code emits.

    python -m kuberay.datadog_assets                # check kuberay/datadog/*.json; exit 1 on a problem
    python -m kuberay.datadog_assets --percentiles  # API bodies that turn on the distributions' percentiles

The assets (`kuberay/datadog/dashboard.json`, `monitors.json`) are Datadog API JSON, pushed as
they are (docs/datadog.md). Each check takes the parsed JSON and returns the problems it found,
each naming the widget or monitor and what is wrong; an empty list means it passed.

- `schema_problems`: the JSON against the Datadog API client's own models (`datadog-api-client`,
  v1 `Dashboard` and `Monitor`). The client is lenient by design (it keeps what it cannot parse,
  for forward compatibility), so the check walks the parsed tree and reports every part the
  client kept unparsed (a wrong enum value, a widget that fits no widget schema) and every field
  its model does not have (a misspelt key).
- `query_problems`: every metric query (a widget's `q` or `queries[].query`, a monitor's
  `query`) names a metric of the catalogs (`raypipe.call.metrics.CATALOG`,
  `serve_app.metrics.CATALOG`) under the namespace; aggregates it as its kind allows
  (percentiles and `count:` only on distributions; counts only as `sum:` with `.as_count()` or
  `.as_rate()`, and those only on counts); filters and groups only by tags the code sets on it,
  with values the code gives closed tags; and uses template variables only where the metric
  carries their tag.
- `dashboard_problems`: template variables name emitted tags and are used; formulas name their
  queries; every catalog metric is on the dashboard, or in `UNDASHBOARDED` with its reason.
- `monitor_problems`: a query of the form `time_agg(last_N): expression > threshold` whose
  threshold is `options.thresholds.critical`, with the warning on the quiet side of it; every
  metric in the expression grouped alike; the message's `{{tag.name}}` among those groups; the
  `raypipe` commands it quotes parse with the real CLI; the docs anchors it names exist;
  `notify_no_data` off on monitors grouped by run (a run's metrics stop when it ends) and on,
  with a `no_data_timeframe` of at least the window, on ungrouped ones (their silence is news).

Datadog lowercases tag values, so values are compared without case (`status:unavailable`
matches the code's `UNAVAILABLE`).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protos.telemetry import Catalog, MetricDef

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "kuberay" / "datadog"
NAMESPACE = "raypipe"
"""The DogStatsD namespace the assets assume (`metrics.namespace`, `ServerMetricsSettings.namespace`)."""

UNDASHBOARDED: dict[str, str] = {}
"""Catalog metrics deliberately left off the dashboard, with the reason."""

_SPACE_AGGS = {"avg", "sum", "min", "max", "count"}
_PERCENTILE = re.compile(r"p\d{1,2}(\.\d{1,2})?")
_REF = re.compile(
    r"(?P<agg>[a-z][a-z0-9.]*):(?P<metric>[A-Za-z_][\w.]*)\{(?P<scope>[^{}]*)\}"
    r"(?:\s*by\s*\{(?P<by>[^{}]*)\})?"
    r"(?P<mods>(?:\.[a-z_]+\([^()]*\))*)"
)
_MODIFIER = re.compile(r"\.([a-z_]+)\(")
_MONITOR_QUERY = re.compile(
    r"^(?P<time_agg>avg|sum|min|max)\(last_(?P<window>\d+[mhd])\):(?P<expr>.+?)\s*"
    r"(?P<op>>=|<=|>|<)\s*(?P<threshold>-?\d+(?:\.\d+)?)$"
)
_MESSAGE_GROUP = re.compile(r"\{\{\s*([\w.-]+)\.name\s*\}\}")
_MESSAGE_COMMAND = re.compile(r"`(raypipe [^`]+)`")
_DOC_LINK = re.compile(r"\b((?:docs/[\w.-]+|README)\.md)#([\w-]+)")
_METRIC_MONITOR_TYPES = {"query alert", "metric alert"}


@dataclass(frozen=True)
class Declared:
    """A catalog metric with its side's catalog, which knows every tag its records carry."""

    metric: MetricDef
    catalog: Catalog

    @property
    def tags(self) -> frozenset[str]:
        return self.catalog.tags_of(self.metric)


def catalog_metrics(namespace: str = NAMESPACE) -> dict[str, Declared]:
    """Every metric both sides emit, by its Datadog name (`raypipe.client.calls`)."""
    from raypipe.call.metrics import CATALOG as client
    from serve_app.metrics import CATALOG as server

    prefix = f"{namespace}." if namespace else ""
    return {prefix + m.name: Declared(m, c) for c in (client, server) for m in c.metrics}


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# --- structure: the Datadog API client's models ---------------------------------------------


def _model_problems(node: Any, path: str, out: list[str]) -> None:
    from datadog_api_client.model_utils import ModelComposed, ModelNormal, ModelSimple, UnparsedObject

    if isinstance(node, UnparsedObject):
        out.append(f"{path}: fits no schema the API client knows")
    elif isinstance(node, ModelSimple):
        if node._unparsed:
            out.append(f"{path}: {node.value!r} is not one of {sorted(node.allowed_values)}")
    elif isinstance(node, ModelComposed):
        raw = next((i for i in node._composed_instances if isinstance(i, UnparsedObject)), None)
        if raw is None:
            for instance in node._composed_instances:
                _model_problems(instance, path, out)
            return
        data = dict(raw._data_store)
        name, found = _closest(node, data, path)
        out.extend(found or [f"{path}: fits none of the schemas of {type(node).__name__} (closest: {name})"])
    elif isinstance(node, ModelNormal):
        for key, value in node._data_store.items():
            if key not in node.openapi_types:
                out.append(f"{path}.{key}: {type(node).__name__} has no such field")
            _model_problems(value, f"{path}.{node.attribute_map.get(key, key)}", out)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            _model_problems(item, f"{path}[{i}]", out)


def _closest(composed: Any, data: dict[str, Any], path: str) -> tuple[str, list[str]]:
    """The one-of schema `data` was most likely meant for, and what is wrong with it there.

    Candidates are the schemas whose enum fields (a widget's `type`, a query's `data_source`)
    all accept `data`'s values, and of them the one with fewest problems wins. With no candidate,
    the problem is the enum value no schema accepts.
    """
    from datadog_api_client.model_utils import ModelSimple

    def enums_accept(schema: Any) -> bool:
        seen = False
        for key, value in data.items():
            kind = schema.openapi_types.get(key, (None,))[0]
            if isinstance(kind, type) and issubclass(kind, ModelSimple) and kind.allowed_values:
                if value not in kind.allowed_values:
                    return False
                seen = True
        return seen

    schemas = list(composed._composed_schemas.get("oneOf", ()))
    pool = [s for s in schemas if enums_accept(s)]
    if not pool:
        offered: dict[str, set[str]] = {}
        for schema in schemas:
            for key in data:
                kind = schema.openapi_types.get(key, (None,))[0]
                if isinstance(kind, type) and issubclass(kind, ModelSimple):
                    offered.setdefault(key, set()).update(map(str, kind.allowed_values))
        wrong = [f"{k} {data[k]!r} is not one of {sorted(v)}" for k, v in offered.items() if data[k] not in v]
        return type(composed).__name__, [f"{path}: {w}" for w in wrong]
    scored = [(s.__name__, _parse_problems(data, s, f"{path}({s.__name__})")) for s in pool]
    return min(scored, key=lambda item: len(item[1]))


def _parse_problems(data: Any, model: type, path: str) -> list[str]:
    from datadog_api_client import Configuration
    from datadog_api_client.exceptions import OpenApiException
    from datadog_api_client.model_utils import validate_and_convert_types

    try:
        parsed = validate_and_convert_types(copy.deepcopy(data), (model,), [path], True, True, Configuration())
    except (OpenApiException, TypeError, ValueError) as e:
        return [f"{path}: {e}"]
    out: list[str] = []
    _model_problems(parsed, path, out)
    return out


def schema_problems(dashboard: Any, monitors: Any) -> list[str]:
    """The dashboard and each monitor against the API client's v1 models."""
    from datadog_api_client.v1.model.dashboard import Dashboard
    from datadog_api_client.v1.model.monitor import Monitor

    out = _parse_problems(dashboard, Dashboard, "dashboard")
    if not isinstance(monitors, list):
        return [*out, "monitors: a JSON list of monitor definitions expected"]
    for i, monitor in enumerate(monitors):
        out += _parse_problems(monitor, Monitor, _monitor_label(i, monitor))
    return out


# --- queries ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """One `agg:metric{scope} by {groups}.modifiers()` in a query."""

    agg: str
    metric: str
    scope: tuple[str, ...]
    by: tuple[str, ...]
    modifiers: tuple[str, ...]


def parse_refs(query: str) -> tuple[list[Ref], list[str]]:
    """The metric references of a query, and what in it looks like one but does not parse."""
    refs, problems = [], []
    for m in _REF.finditer(query):
        refs.append(
            Ref(m["agg"], m["metric"], _split(m["scope"]), _split(m["by"]), tuple(_MODIFIER.findall(m["mods"])))
        )
    rest = _REF.sub(" ", query)
    if "{" in rest or "}" in rest or re.search(rf"\b{NAMESPACE}\.", rest):
        problems.append(f"cannot read a metric reference in {rest.strip()!r}")
    if not refs:
        problems.append("no metric reference")
    return refs, problems


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def ref_problems(ref: Ref, declared: dict[str, Declared], variables: dict[str, str] | None) -> list[str]:
    """What is wrong with one reference: the metric, its aggregation, its tags and variables."""
    d = declared.get(ref.metric)
    if d is None:
        return [f"{ref.metric}: no such metric in the catalogs"]
    kind, out = d.metric.kind, []
    percentile = bool(_PERCENTILE.fullmatch(ref.agg))
    if ref.agg not in _SPACE_AGGS and not percentile:
        out.append(f"{ref.metric}: {ref.agg!r} is not a space aggregation")
    if (percentile or ref.agg == "count") and kind != "distribution":
        out.append(f"{ref.metric}: {ref.agg}: needs a distribution, this is a {kind}")
    counted = {"as_count", "as_rate"} & set(ref.modifiers)
    if counted and kind != "count":
        out.append(f"{ref.metric}: .{sorted(counted)[0]}() is for counts, this is a {kind}")
    if kind == "count" and not counted:
        out.append(f"{ref.metric}: a count needs .as_count() or .as_rate()")
    if kind == "count" and ref.agg != "sum":
        out.append(f"{ref.metric}: counts add up across sources: sum:, not {ref.agg}:")
    unknown_mods = set(ref.modifiers) - {"as_count", "as_rate", "rollup", "fill"}
    if unknown_mods:
        out.append(f"{ref.metric}: unknown modifiers {sorted(unknown_mods)}")
    for item in ref.scope:
        out += _scope_problems(ref.metric, d, item, variables)
    for tag in ref.by:
        if tag not in d.tags:
            out.append(f"{ref.metric}: grouped by {tag!r}, which it does not carry (it has {sorted(d.tags)})")
    return out


def _scope_problems(metric: str, d: Declared, item: str, variables: dict[str, str] | None) -> list[str]:
    if item == "*":
        return []
    if item.startswith("$"):
        name = item[1:].split(".")[0]
        if variables is None:
            return [f"{metric}: template variable {item} outside a dashboard"]
        if name not in variables:
            return [f"{metric}: template variable {item} is not defined"]
        if variables[name] not in d.tags:
            return [
                f"{metric}: ${name} filters on {variables[name]!r}, which it does not carry (it has {sorted(d.tags)})"
            ]
        return []
    key, sep, value = item.removeprefix("!").partition(":")
    if not sep or not re.fullmatch(r"[a-z][\w.-]*", key) or not value:
        return [f"{metric}: cannot read the filter {item!r} (use tag:value, !tag:value, $var or *)"]
    if key not in d.tags:
        return [f"{metric}: filtered on {key!r}, which it does not carry (it has {sorted(d.tags)})"]
    allowed = d.metric.allowed(key)
    closed = allowed is not None and "*" not in value and not value.startswith("$")
    if closed and value.lower() not in {v.lower() for v in allowed or ()}:
        return [f"{metric}: {key}:{value} is never emitted (values: {', '.join(sorted(allowed or ()))})"]
    return []


def widget_queries(widgets: list[Any], path: str = "dashboard") -> Iterator[tuple[str, dict[str, Any], list[Any]]]:
    """(path, request, its queries) of every widget request, groups included."""
    for i, widget in enumerate(widgets or []):
        definition = widget.get("definition", {})
        here = f"{path}.widgets[{i}]({definition.get('title') or definition.get('type')})"
        if definition.get("type") == "group":
            yield from widget_queries(definition.get("widgets", []), here)
        for j, request in enumerate(definition.get("requests") or []):
            queries = [request["q"]] if "q" in request else []
            queries += [q.get("query", "") for q in request.get("queries") or [] if q.get("data_source") == "metrics"]
            yield f"{here}.requests[{j}]", request, queries


def template_variables(dashboard: dict[str, Any]) -> dict[str, str]:
    """Template variable name -> the tag it filters on."""
    return {v.get("name"): v.get("prefix") for v in dashboard.get("template_variables") or []}


def query_problems(dashboard: Any, monitors: Any, declared: dict[str, Declared] | None = None) -> list[str]:
    """Every metric reference of the dashboard and the monitors against the catalogs."""
    declared = declared if declared is not None else catalog_metrics()
    out: list[str] = []
    variables = template_variables(dashboard)
    for path, _, queries in widget_queries(dashboard.get("widgets", [])):
        for query in queries:
            refs, problems = parse_refs(query)
            out += [f"{path}: {p}" for p in problems]
            for ref in refs:
                out += [f"{path}: {p}" for p in ref_problems(ref, declared, variables)]
    for i, monitor in enumerate(monitors or []):
        if monitor.get("type") not in _METRIC_MONITOR_TYPES:
            out.append(
                f"{_monitor_label(i, monitor)}: only metric monitors are checked here, not {monitor.get('type')!r}"
            )
            continue
        refs, problems = parse_refs(monitor.get("query", ""))
        out += [f"{_monitor_label(i, monitor)}: {p}" for p in problems]
        for ref in refs:
            out += [f"{_monitor_label(i, monitor)}: {p}" for p in ref_problems(ref, declared, None)]
    return out


# --- the dashboard as a whole -----------------------------------------------------------------


def dashboard_problems(dashboard: Any, declared: dict[str, Declared] | None = None) -> list[str]:
    """Template variables, formulas, and every catalog metric on the dashboard."""
    declared = declared if declared is not None else catalog_metrics()
    out: list[str] = []
    emitted_tags = {t for d in declared.values() for t in d.tags}
    variables = template_variables(dashboard)
    used: set[str] = set()
    shown: set[str] = set()
    for path, request, queries in widget_queries(dashboard.get("widgets", [])):
        for query in queries:
            used |= set(re.findall(r"\$(\w+)", query))
            shown |= {r.metric for r in parse_refs(query)[0]}
        names = {q.get("name") for q in request.get("queries") or []}
        for formula in request.get("formulas") or []:
            missing = set(re.findall(r"\b([a-z_][a-z0-9_]*)\b(?!\()", formula.get("formula", ""))) - names
            if missing:
                out.append(f"{path}: formula {formula.get('formula')!r} names no query {sorted(missing)}")
    for name, prefix in variables.items():
        if prefix not in emitted_tags:
            out.append(f"template variable {name}: {prefix!r} is a tag no metric carries")
        if name not in used:
            out.append(f"template variable {name}: no query uses ${name}")
    for name in sorted(set(declared) - shown):
        if declared[name].metric.name not in UNDASHBOARDED:
            out.append(f"{name} ({declared[name].metric.doc}) is on no widget; show it or list it in UNDASHBOARDED")
    return out


# --- monitors ---------------------------------------------------------------------------------


def _monitor_label(i: int, monitor: Any) -> str:
    name = monitor.get("name") if isinstance(monitor, dict) else None
    return f"monitors[{i}]({name})"


def monitor_problems(monitors: Any) -> list[str]:
    """Thresholds, groups, and the message's variables, commands and links."""
    out: list[str] = []
    names = [m.get("name") for m in monitors or []]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        out.append(f"monitor name {dup!r} is used twice (pushing updates finds monitors by name)")
    for i, monitor in enumerate(monitors or []):
        label = _monitor_label(i, monitor)
        m = _MONITOR_QUERY.match(monitor.get("query", "").strip())
        if m is None:
            out.append(f"{label}: the query is not of the form time_agg(last_N): expression > threshold")
            continue
        refs, _ = parse_refs(m["expr"])
        thresholds = monitor.get("options", {}).get("thresholds", {})
        critical, warning = thresholds.get("critical"), thresholds.get("warning")
        if critical is None or float(critical) != float(m["threshold"]):
            out.append(f"{label}: options.thresholds.critical {critical} is not the query's {m['threshold']}")
        above = m["op"].startswith(">")
        if warning is not None and critical is not None and (warning >= critical if above else warning <= critical):
            out.append(f"{label}: the warning {warning} must come before the critical {critical} ({m['op']})")
        if any("as_count" in r.modifiers for r in refs) and m["time_agg"] != "sum":
            out.append(f"{label}: counts over a window add up: sum(last_{m['window']}), not {m['time_agg']}")
        groups = {r.by for r in refs}
        if len(groups) > 1:
            out.append(f"{label}: the metrics are grouped differently {sorted(groups)}; Datadog joins them by group")
        by = set(next(iter(groups), ()))
        out += [f"{label}: {p}" for p in _no_data_problems(monitor.get("options", {}), by, m["window"])]
        message = monitor.get("message", "")
        for tag in _MESSAGE_GROUP.findall(message):
            if tag not in by:
                out.append(f"{label}: the message names {{{{{tag}.name}}}}, not a group of the query ({sorted(by)})")
        out += [f"{label}: {p}" for p in message_problems(message)]
    return out


_WINDOW_MINUTES = {"m": 1, "h": 60, "d": 1440}


def _no_data_problems(options: dict[str, Any], by: set[str], window: str) -> list[str]:
    """Missing data alerts where its absence is the news, and only there.

    A monitor grouped by `run_id` (or `actor`) watches runs, and a run's metrics stop when it
    ends: alerting on their absence would page after every run. A monitor over the whole fleet
    (no group) watches for something that should keep coming, such as a finished daily run: with
    `notify_no_data` off it would stay silent exactly when nothing arrives.
    """
    out = []
    notify = options.get("notify_no_data", False)
    per_run = bool(by & {"run_id", "actor"})
    if per_run and notify:
        out.append(f"notify_no_data on a monitor grouped by {sorted(by)}: every run that ends would alert")
    if not by and not notify:
        out.append("an ungrouped monitor needs notify_no_data: when nothing arrives it would stay silent")
    if notify:
        minutes = int(window[:-1]) * _WINDOW_MINUTES[window[-1]]
        timeframe = options.get("no_data_timeframe")
        if not isinstance(timeframe, int) or timeframe < minutes:
            out.append(f"no_data_timeframe {timeframe} must be set, in minutes, to at least the window ({minutes})")
    return out


def message_problems(message: str) -> list[str]:
    """The `raypipe ...` commands a message quotes parse with the CLI; its doc links exist."""
    from kuberay.entrypoints import parse_raypipe

    out: list[str] = []
    for command in _MESSAGE_COMMAND.findall(message):
        filled = re.sub(r"\{\{[^}]*\}\}|<[A-Z_]+>", "x", command)
        _, error = parse_raypipe(shlex.split(filled)[1:])
        if error is not None:
            out.append(f"`{command}`: {error}")
    for path, anchor in _DOC_LINK.findall(message):
        doc = REPO / path
        if not doc.is_file():
            out.append(f"{path}#{anchor}: no such file")
        elif anchor not in _anchors(doc):
            out.append(f"{path}#{anchor}: no such heading")
    return out


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    found = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


# --- all of it --------------------------------------------------------------------------------


def problems(dashboard: Any, monitors: Any, declared: dict[str, Declared] | None = None) -> list[str]:
    """Every check on a dashboard and a list of monitors."""
    declared = declared if declared is not None else catalog_metrics()
    return [
        *schema_problems(dashboard, monitors),
        *query_problems(dashboard, monitors, declared),
        *dashboard_problems(dashboard, declared),
        *monitor_problems(monitors),
    ]


def percentile_configs(declared: dict[str, Declared] | None = None) -> list[dict[str, Any]]:
    """For each distribution, the body of `POST /api/v2/metrics/<name>/tags` that turns on its
    percentiles (p50..p99 return nothing until they are on), keeping every tag the code sets
    queryable. Such a configuration makes only the listed tags queryable: add any
    `metrics.tags` keys of yours (e.g. `env`)."""
    declared = declared if declared is not None else catalog_metrics()
    return [
        {
            "data": {
                "type": "manage_tags",
                "id": name,
                "attributes": {"metric_type": "distribution", "include_percentiles": True, "tags": sorted(d.tags)},
            }
        }
        for name, d in sorted(declared.items())
        if d.metric.kind == "distribution"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kuberay.datadog_assets", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ASSETS, help="where dashboard.json and monitors.json are")
    parser.add_argument("--percentiles", action="store_true", help="print the percentile configurations, one a line")
    args = parser.parse_args(argv)
    if args.percentiles:
        for body in percentile_configs():
            print(json.dumps(body))
        return 0
    found = problems(load(args.dir / "dashboard.json"), load(args.dir / "monitors.json"))
    for p in found:
        print(p)
    if not found:
        print(f"{args.dir}: dashboard and monitors match the metrics raypipe emits")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

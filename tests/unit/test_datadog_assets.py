"""The Datadog dashboard and monitors (kuberay/datadog/) against the API's models and the
metric catalogs: the shipped files pass, and each kind of break in a copy of them is reported."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from kuberay import datadog_assets as dd
from protos.telemetry import Catalog, MetricDef
from raypipe.call.metrics import CATALOG as CLIENT
from serve_app.metrics import CATALOG as SERVER

DASHBOARD = dd.load(dd.ASSETS / "dashboard.json")
MONITORS = dd.load(dd.ASSETS / "monitors.json")

WATCH_CONTRACT = Catalog(
    "client",
    CLIENT.constant_tags,
    (
        MetricDef("watch.freshness_p50_s", "gauge", "arrival to commit, p50 over the report window (s)"),
        MetricDef("watch.freshness_p95_s", "gauge", "arrival to commit, p95 over the report window (s)"),
        MetricDef("watch.backlog_rows", "gauge", "rows arrived and not committed"),
        MetricDef("watch.backlog_files", "gauge", "files arrived and not committed"),
        MetricDef("watch.oldest_waiting_s", "gauge", "age of the oldest uncommitted arrival (s)"),
        MetricDef("watch.ticks", "count", "planning ticks"),
    ),
)
"""The watcher's metrics as its contract names them: gauges and a count, with the run's tags."""


@pytest.fixture
def watch_metrics(monkeypatch: pytest.MonkeyPatch) -> dict[str, dd.Declared]:
    """The catalogs, with the watcher's contract metrics wherever `raypipe.call.metrics` does not
    declare them yet (the code's declaration wins where there is one)."""
    declared = dd.catalog_metrics()
    for m in WATCH_CONTRACT.metrics:
        declared.setdefault(f"{dd.NAMESPACE}.{m.name}", dd.Declared(m, WATCH_CONTRACT))
    monkeypatch.setattr(dd, "catalog_metrics", lambda namespace=dd.NAMESPACE: dict(declared))
    return declared


def _widget(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    """The definition of the widget titled `title`, groups included."""

    def walk(widgets):
        for w in widgets:
            d = w["definition"]
            if d.get("title") == title:
                return d
            if d["type"] == "group" and (found := walk(d["widgets"])) is not None:
                return found
        return None

    found = walk(dashboard["widgets"])
    assert found is not None, title
    return found


def _monitor(monitors: list[dict[str, Any]], word: str) -> dict[str, Any]:
    return next(m for m in monitors if word in m["name"])


def _broken_dashboard(title: str, query: str, index: int = 0) -> list[str]:
    dash = copy.deepcopy(DASHBOARD)
    _widget(dash, title)["requests"][0]["queries"][index]["query"] = query
    return dd.query_problems(dash, [])


def _has(found: list[str], *words: str) -> None:
    """`found` reports a problem naming all of `words`."""
    assert any(all(w in p for w in words) for p in found), found


def test_the_shipped_dashboard_and_monitors_pass_every_check(watch_metrics):
    assert dd.problems(DASHBOARD, MONITORS) == []
    assert dd.main([]) == 0


def test_the_dashboard_filters_run_metrics_by_run_and_the_replicas_only_by_app_and_version():
    for path, _, queries in dd.widget_queries(DASHBOARD["widgets"]):
        for q in queries:
            if "raypipe.server." in q:
                assert "{$app,$model_version}" in q.replace("status:ok,", "") and not re.search(r"\$(run_id|mode)\b", q)
            else:
                assert "$run_id,$mode,$app,$model_version}" in q, (path, q)


# --- structure, through the API client's models ----------------------------------------------


@pytest.mark.parametrize(
    ("where", "change", "words"),
    [
        ("widget field", lambda d: _widget(d, "Rows by outcome").__setitem__("titel", "x"), ("titel", "no such field")),
        (
            "request enum",
            lambda d: _widget(d, "Rows by outcome")["requests"][0].__setitem__("display_type", "stacked"),
            ("'stacked'",),
        ),
        ("widget type", lambda d: _widget(d, "Rows by outcome").__setitem__("type", "timeserie"), ("'timeserie'",)),
        ("layout", lambda d: d.__setitem__("layout_type", "grid"), ("'grid'",)),
        (
            "query without a name",
            lambda d: _widget(d, "Rows by outcome")["requests"][0]["queries"][0].pop("name"),
            ("name",),
        ),
    ],
)
def test_a_dashboard_the_api_would_refuse_is_reported(where, change, words):
    dash = copy.deepcopy(DASHBOARD)
    change(dash)
    found = dd.schema_problems(dash, [])
    assert found and all(any(w in p for p in found) for w in words), (where, found)


@pytest.mark.parametrize(
    ("change", "word"),
    [
        (lambda m: m.__setitem__("type", "metric alrt"), "'metric alrt'"),
        (lambda m: m["options"]["thresholds"].__setitem__("crit", 1), "crit"),
        (lambda m: m["options"].__setitem__("notify_no_data", "no"), "notify_no_data"),
        (lambda m: m.pop("query"), "query"),
    ],
)
def test_a_monitor_the_api_would_refuse_is_reported(change, word):
    monitors = copy.deepcopy(MONITORS)
    change(monitors[2])
    found = dd.schema_problems(DASHBOARD, monitors)
    assert found and all(p.startswith("monitors[2]") for p in found) and any(word in p for p in found), found


# --- queries against the catalogs ------------------------------------------------------------


def test_an_unknown_metric_is_reported():
    _has(_broken_dashboard("Units committed", "sum:raypipe.run.unit{$run_id} by {run_id}.as_count()"), "no such metric")


def test_a_tag_the_metric_does_not_carry_is_reported_in_a_filter_a_group_and_a_variable():
    _has(_broken_dashboard("Units committed", "sum:raypipe.run.units{actor:a1,$run_id}.as_count()"), "'actor'")
    _has(
        _broken_dashboard("Paragraphs answered/s", "sum:raypipe.server.paragraphs{$app} by {run_id}.as_rate()"),
        "run_id",
    )
    _has(
        _broken_dashboard("Paragraphs answered/s", "sum:raypipe.server.paragraphs{status:ok,$run_id}.as_rate()"),
        "$run_id",
        "'run_id'",
    )


def test_a_percentile_of_a_count_and_a_count_of_a_gauge_are_reported():
    _has(_broken_dashboard("Units committed", "p95:raypipe.run.units{$run_id}.as_count()"), "needs a distribution")
    _has(_broken_dashboard("Units left by run", "max:raypipe.run.units_left{$run_id}.as_count()"), "is for counts")
    _has(_broken_dashboard("Units left by run", "p99:raypipe.run.units_left{$run_id}"), "needs a distribution")


def test_a_count_must_be_summed_with_as_count_or_as_rate():
    _has(_broken_dashboard("Units committed", "sum:raypipe.run.units{$run_id}"), ".as_count() or .as_rate()")
    _has(_broken_dashboard("Units committed", "avg:raypipe.run.units{$run_id}.as_count()"), "sum:")


def test_a_value_the_code_never_gives_a_closed_tag_is_reported_whatever_its_case(watch_metrics):
    _has(_broken_dashboard("Rows by outcome", "sum:raypipe.run.rows{outcome:dead_letters,$run_id}.as_count()"), "never")
    assert _broken_dashboard("Rows by outcome", "sum:raypipe.run.rows{outcome:DEAD_LETTER,$run_id}.as_count()") == []
    _has(
        _broken_dashboard("Errors by status", "sum:raypipe.server.errors{status:unavailible,$app}.as_count()"), "never"
    )
    assert _broken_dashboard("Errors by status", "sum:raypipe.server.errors{!status:ok,$app}.as_count()") == []


def test_a_filter_or_reference_that_does_not_parse_is_reported():
    _has(_broken_dashboard("Units committed", "sum:raypipe.run.units{$run_id} by {run_id.as_count()"), "cannot read")
    _has(_broken_dashboard("Units committed", "sum:raypipe.run.units{run_id IN (a,b)}.as_count()"), "cannot read")


def test_template_variables_must_be_defined_name_emitted_tags_and_be_used():
    _has(_broken_dashboard("Units committed", "sum:raypipe.run.units{$run}.as_count()"), "$run is not defined")
    dash = copy.deepcopy(DASHBOARD)
    dash["template_variables"].append({"name": "env", "prefix": "env", "defaults": ["*"]})
    found = dd.dashboard_problems(dash)
    assert any("'env' is a tag no metric carries" in p for p in found)
    assert any("no query uses $env" in p for p in found), found


def test_a_formula_naming_no_query_is_reported():
    dash = copy.deepcopy(DASHBOARD)
    _widget(dash, "Dead-letter share")["requests"][0]["formulas"][0]["formula"] = "100 * dead / row"
    _has(dd.dashboard_problems(dash), "['row']")


def test_every_catalog_metric_is_on_the_dashboard_unless_left_off_with_a_reason(monkeypatch):
    dash = copy.deepcopy(DASHBOARD)
    for title in ("ETA (latest)", "ETA (s) by run"):
        _widget(dash, title)["requests"][0]["queries"][0]["query"] = (
            "max:raypipe.run.units_left{$run_id,$mode,$app,$model_version}"
        )
    _has(dd.dashboard_problems(dash), "raypipe.run.eta_s", "UNDASHBOARDED")
    monkeypatch.setitem(dd.UNDASHBOARDED, "run.eta_s", "shown by the driver's progress lines instead")
    assert dd.dashboard_problems(dash) == []


def test_the_catalogs_seen_by_the_checks_are_the_codes():
    declared = dd.catalog_metrics()
    assert set(declared) == {f"raypipe.{m.name}" for c in (CLIENT, SERVER) for m in c.metrics}
    assert declared["raypipe.run.rows"].tags == {"run_id", "mode", "model_version", "app", "outcome"}
    assert declared["raypipe.server.queue_ms"].tags == {"app", "model_version", "setting"}


# --- monitors ---------------------------------------------------------------------------------


def _broken_monitor(word: str, **changes: Any) -> list[str]:
    monitors = copy.deepcopy(MONITORS)
    m = _monitor(monitors, word)
    for key, value in changes.items():
        if key == "thresholds":
            m["options"]["thresholds"] = value
        else:
            m[key] = value
    return dd.query_problems(DASHBOARD, monitors) + dd.monitor_problems(monitors)


def test_a_monitor_threshold_apart_from_its_query_is_reported():
    _has(_broken_monitor("failed", thresholds={"critical": 1}), "critical 1")
    _has(_broken_monitor("no progress", thresholds={"critical": 1800, "warning": 2000}), "warning 2000")


def test_a_monitor_on_an_unknown_metric_or_tag_is_reported():
    _has(
        _broken_monitor("failed", query="sum(last_5m):sum:raypipe.run.failed{*} by {run_id}.as_count() > 0"), "no such"
    )
    _has(
        _broken_monitor(
            "failed", query="sum(last_5m):sum:raypipe.run.finished{status:failure} by {run_id}.as_count() > 0"
        ),
        "status:failure",
    )
    _has(
        _broken_monitor(
            "queue wait", query="avg(last_10m):p95:raypipe.server.queue_ms{*} by {run_id} > 5000", message="x"
        ),
        "grouped by 'run_id'",
    )


def test_a_monitor_whose_ratio_groups_differ_or_whose_counts_are_not_summed_is_reported():
    q = (
        "sum(last_15m):sum:raypipe.client.calls{!status:ok} by {run_id}.as_count()"
        " / sum:raypipe.client.calls{*}.as_count() > 0.5"
    )
    _has(_broken_monitor("call errors", query=q), "grouped differently")
    q = "avg(last_5m):sum:raypipe.run.finished{status:failed} by {run_id}.as_count() > 0"
    _has(_broken_monitor("failed", query=q), "sum(last_5m)")


def test_a_monitor_message_naming_a_group_the_query_lacks_is_reported():
    _has(_broken_monitor("failed", message="Run {{run_id.name}} in {{mode.name}} failed"), "{{mode.name}}")


def test_a_monitor_message_quoting_a_command_the_cli_refuses_or_a_missing_anchor_is_reported():
    _has(_broken_monitor("failed", message="`raypipe report --outpt <OUTPUT> --run-id {{run_id.name}}`"), "--outpt")
    _has(_broken_monitor("failed", message="`raypipe rerun --output <OUTPUT>`"), "rerun")
    _has(_broken_monitor("failed", message="see docs/datadog.md#run-faild"), "no such heading")
    _has(_broken_monitor("failed", message="see docs/datadog2.md#run-failed"), "no such file")


def test_two_monitors_of_one_name_are_reported():
    monitors = copy.deepcopy(MONITORS)
    monitors[1]["name"] = monitors[0]["name"]
    assert any("used twice" in p for p in dd.monitor_problems(monitors))


def test_every_monitor_message_says_what_to_do_and_links_its_section():
    for m in MONITORS:
        assert re.search(r"docs/(datadog|kuberay)\.md#", m["message"]), m["name"]
        assert {"service:raypipe", "managed_by:raypipe-assets"} <= set(m["tags"])
        if "by {run_id}" in m["query"]:
            assert m["options"]["notify_no_data"] is False, "runs end: their metrics stop with them"


def _hours(window: str) -> float:
    return int(window[:-1]) * {"m": 1 / 60, "h": 1, "d": 24}[window[-1]]


def test_a_daily_run_that_never_reports_finishing_alerts_within_the_next_day():
    """A driver killed before `run.finished`, or a tick that started nothing, sends no data: one
    ungrouped monitor alerts on that silence, over a window that outlasts a run's deadline and
    ends before the next tick's run could hide the missed one."""
    from kuberay import validate

    m = _monitor(MONITORS, "no daily run finished")
    query = dd._MONITOR_QUERY.match(m["query"])
    assert query is not None
    refs, _ = dd.parse_refs(query["expr"])
    assert [(r.metric, r.by) for r in refs] == [("raypipe.run.finished", ())], "over all runs, ungrouped"
    assert "mode:daily" in m["query"] and query["op"] == "<" and float(query["threshold"]) == 1
    assert m["options"]["notify_no_data"] is True
    window_h = _hours(query["window"])
    assert m["options"]["no_data_timeframe"] >= window_h * 60
    for overlay in ("prod", "prod-kuberay-1.5"):
        (daily,) = [j for j in validate.jobs(validate.render(validate.OVERLAYS / overlay)) if j.scheduled]
        longest_run_h = daily.spec["activeDeadlineSeconds"] * (daily.spec["backoffLimit"] + 1) / 3600
        # two successive finishes are at most a day plus the longest run apart: no false alert
        assert window_h >= 24 + longest_run_h, (overlay, window_h, longest_run_h)
        # a missed tick is seen before the next tick starts another run
        assert window_h < 48 - 1, (overlay, window_h)


@pytest.mark.parametrize(
    ("word", "options", "words"),
    [
        ("failed", {"notify_no_data": True, "no_data_timeframe": 10}, ("every run that ends would alert",)),
        ("no daily run finished", {"notify_no_data": False}, ("ungrouped monitor needs notify_no_data",)),
        ("no daily run finished", {"no_data_timeframe": 60}, ("no_data_timeframe 60", "(2160)")),
        ("no daily run finished", {"no_data_timeframe": None}, ("no_data_timeframe None",)),
    ],
)
def test_missing_data_alerts_only_where_silence_is_the_news(
    word: str, options: dict[str, Any], words: tuple[str, ...]
) -> None:
    monitors = copy.deepcopy(MONITORS)
    _monitor(monitors, word)["options"].update(options)
    _has(dd.monitor_problems(monitors), *words)


# --- the rest ---------------------------------------------------------------------------------


def test_percentile_configs_cover_the_distributions_and_fit_the_api_model():
    from datadog_api_client.v2.model.metric_tag_configuration_create_request import (
        MetricTagConfigurationCreateRequest,
    )

    bodies = dd.percentile_configs()
    distributions = {f"raypipe.{m.name}" for c in (CLIENT, SERVER) for m in c.metrics if m.kind == "distribution"}
    assert {b["data"]["id"] for b in bodies} == distributions
    for body in bodies:
        assert dd._parse_problems(body, MetricTagConfigurationCreateRequest, body["data"]["id"]) == []


def test_the_docs_table_names_every_metric(watch_metrics):
    doc = (dd.REPO / "docs" / "datadog.md").read_text(encoding="utf-8")
    missing = [name for name in dd.catalog_metrics() if f"| `{name}` |" not in doc]
    assert missing == []


def test_the_command_line_fails_on_a_broken_copy(tmp_path, capsys):
    (tmp_path / "dashboard.json").write_text(json.dumps(DASHBOARD))
    monitors = copy.deepcopy(MONITORS)
    monitors[0]["query"] = monitors[0]["query"].replace("raypipe.run.rows", "raypipe.run.row")
    (tmp_path / "monitors.json").write_text(json.dumps(monitors))
    assert dd.main(["--dir", str(tmp_path)]) == 1
    assert "raypipe.run.row: no such metric" in capsys.readouterr().out


# --- the watcher's monitors and panel ---------------------------------------------------------


def test_the_watch_panel_shows_every_watch_metric(watch_metrics):
    group = _widget(DASHBOARD, "Watch: freshness and backlog (raypipe watch)")
    shown = {
        r.metric for _, _, queries in dd.widget_queries(group["widgets"]) for q in queries for r in dd.parse_refs(q)[0]
    }
    assert {f"raypipe.{m.name}" for m in WATCH_CONTRACT.metrics} <= shown
    assert {name for name in watch_metrics if name.startswith("raypipe.watch.")} <= shown


def test_the_freshness_monitor_alerts_on_p95_freshness_over_its_threshold(watch_metrics):
    m = _monitor(MONITORS, "watch freshness")
    query = dd._MONITOR_QUERY.match(m["query"])
    assert query is not None
    refs, _ = dd.parse_refs(query["expr"])
    assert [(r.metric, r.scope) for r in refs] == [("raypipe.watch.freshness_p95_s", ("mode:watch",))]
    assert query["op"] == ">"
    # above the 2-minute target at --every 60s: it pages on a watcher well off it, not on noise
    assert m["options"]["thresholds"]["warning"] > 120 and float(query["threshold"]) > 120
    # freshness has no data while nothing arrives: silence is not news here
    assert m["options"]["notify_no_data"] is False and refs[0].by


def test_the_oldest_waiting_monitor_alerts_on_a_stuck_backlog_and_on_a_silent_watcher(watch_metrics):
    m = _monitor(MONITORS, "watcher falling behind")
    query = dd._MONITOR_QUERY.match(m["query"])
    assert query is not None
    refs, _ = dd.parse_refs(query["expr"])
    assert [(r.metric, r.scope, r.by) for r in refs] == [("raypipe.watch.oldest_waiting_s", ("mode:watch",), ())]
    assert query["op"] == ">" and query["time_agg"] == "min"  # above it for the whole window
    assert m["options"]["notify_no_data"] is True
    assert m["options"]["no_data_timeframe"] >= _hours(query["window"]) * 60
    assert "{{#is_no_data}}" in m["message"] and "raypipe-watch" in m["message"]


@pytest.mark.parametrize(
    ("word", "change", "words"),
    [
        (
            "watch freshness",
            {"query": "avg(last_30m):max:raypipe.watch.freshness_p95{mode:watch} by {app} > 600"},
            ("raypipe.watch.freshness_p95: no such metric",),
        ),
        (
            "watch freshness",
            {"query": "avg(last_30m):p95:raypipe.watch.freshness_p95_s{mode:watch} by {app} > 600"},
            ("p95: needs a distribution",),
        ),
        (
            "watcher falling behind",
            {"query": "min(last_15m):max:raypipe.watch.oldest_waiting_s{mode:watch} by {output} > 1800"},
            ("grouped by 'output'",),
        ),
        (
            "watcher falling behind",
            {"query": "min(last_15m):max:raypipe.watch.oldest_waiting_s{mode:watch} > 900"},
            ("critical 1800 is not the query's 900",),
        ),
        (
            "watch freshness",
            {"message": "`raypipe lease show --outpt <OUTPUT>` docs/datadog.md#watch-freshness"},
            ("--outpt",),
        ),
    ],
)
def test_broken_watch_monitors_are_reported(watch_metrics, word: str, change: dict[str, Any], words: tuple[str, ...]):
    _has(_broken_monitor(word, **change), *words)


def test_a_silent_watcher_must_alert(watch_metrics):
    monitors = copy.deepcopy(MONITORS)
    _monitor(monitors, "watcher falling behind")["options"]["notify_no_data"] = False
    _has(dd.monitor_problems(monitors), "ungrouped monitor needs notify_no_data")


def _seconds(text: str) -> float:
    value, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m|h)?", text).groups()  # type: ignore[union-attr]
    return float(value) * {"s": 1, "m": 60, "h": 3600}[unit or "s"]


def test_the_watch_thresholds_leave_room_for_a_tick_and_a_cut_of_the_shipped_watcher(watch_metrics):
    """An arrival waits up to --every to be seen and --max-wait to be cut before its commit
    starts: a threshold below their sum would warn on a watcher doing as configured."""
    import shutil

    from kuberay import validate

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    (watch,) = [j for j in validate.jobs(validate.render(validate.OVERLAYS / "prod-watch")) if j.watch]
    flags = dict(re.findall(r"--(every|max-wait) (\S+)", watch.spec["entrypoint"]))
    floor = _seconds(flags["every"]) + _seconds(flags["max-wait"])
    for word in ("watch freshness", "watcher falling behind"):
        assert _monitor(MONITORS, word)["options"]["thresholds"]["warning"] > floor, word

"""docs/configuration.md's settings are the models' (`raypipe.config_docs`), and what the page
says of the environment holds for `load_config`."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypipe import config_docs
from raypipe.config import load_config

ROOT = Path(__file__).resolve().parents[2]

#: A valid value for each setting whose default cannot be given back as a string.
SAMPLES = {
    "input.uri": "/data/shards",
    "input.updated_at_partition": "updated_date",
    "input.on_bad_shard": "record",
    "output.uri": "/data/out",
    "service.ca_file": "/etc/ca.pem",
    "service.server_name": "raypipe-serve-svc",
    "service.token_env": "RAYPIPE_TOKEN",
    "actors.max_actors": "3",
    "metrics.dogstatsd_host": "127.0.0.1",
}
TLS_ONLY = {"service.ca_file", "service.server_name", "service.token_env"}


def test_the_page_shows_every_setting_as_the_models_define_it():
    # Add, rename, re-default or re-describe a field without `python -m raypipe.config_docs`: this fails.
    assert config_docs.main(["--check", "--root", str(ROOT)]) == 0


def test_check_reports_a_page_that_differs_and_writes_nothing(tmp_path, capsys):
    page = tmp_path / "docs" / "configuration.md"
    page.parent.mkdir()
    hand = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8").replace("100,000,000", "20,000,000")
    page.write_text(hand, encoding="utf-8")
    assert config_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "python -m raypipe.config_docs" in capsys.readouterr().err
    assert page.read_text(encoding="utf-8") == hand
    assert config_docs.main(["--root", str(tmp_path)]) == 0
    assert "| 100,000,000 |" in page.read_text(encoding="utf-8")


def test_every_setting_has_a_docstring():
    assert [s.name for s in config_docs.settings() if not (s.field.description or "").strip()] == []


@pytest.mark.parametrize("setting", [s for s in config_docs.settings() if config_docs.env_var(s)], ids=lambda s: s.name)
def test_each_environment_variable_the_page_names_sets_its_setting(setting):
    name, var = setting.name, config_docs.env_var(setting)
    assert var is not None
    if var.endswith("__<KEY>"):  # a map: one variable per key
        config = load_config(environ={"RAYPIPE_OUTPUT__URI": "/o", var.replace("<KEY>", "ENV"): "prod"})
        assert config.metrics.tags == {"env": "prod"}
        return
    default = setting.field.default
    value = SAMPLES.get(name, str(default).lower() if isinstance(default, bool) else str(default))
    environ = {"RAYPIPE_OUTPUT__URI": "/o", "RAYPIPE_INPUT__URI": "/i", var: value}
    if name in TLS_ONLY:
        environ["RAYPIPE_SERVICE__TLS"] = "true"
    config = load_config(environ=environ, offline=True)
    *sections, field = setting.path
    node = config
    for section in sections:
        node = getattr(node, section)
    assert field in node.model_fields_set, f"{var} did not set {name}"


def test_top_level_settings_have_no_environment_variable_and_the_page_says_so():
    top = [s for s in config_docs.settings() if len(s.path) == 1]
    assert {s.name for s in top} >= {"run_id", "core_hour_usd"}
    assert all(config_docs.env_var(s) is None for s in top)
    # What the page warns of: the variable is read by nothing.
    assert load_config(environ={"RAYPIPE_OUTPUT__URI": "/o", "RAYPIPE_CORE_HOUR_USD": "9"}).core_hour_usd == 0.04
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert "`RAYPIPE_CORE_HOUR_USD` is ignored" in page
    assert "| `core_hour_usd` | float, ≥ 0 | 0.04 | – |" in page

"""The typed config: layering, validation, and clear errors before any data is read."""

from __future__ import annotations

import pytest

from raypipe.config import PipelineConfig, default_max_actors, load_config, run_input
from raypipe.errors import ConfigError


def test_layers_file_then_env_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "input: {uri: s3://bucket/in/}\noutput: {uri: /tmp/out}\nservice: {address: 'a:1', timeout_s: 7}\n"
        "client: {micro_batch_size: 16}\n"
    )
    env = {"RAYPIPE_SERVICE__ADDRESS": "b:2", "RAYPIPE_CLIENT__RETRY__MAX_ATTEMPTS": "6", "UNRELATED": "x"}
    cfg = load_config(f, {"client": {"micro_batch_size": 8}}, environ=env)
    assert isinstance(cfg, PipelineConfig)
    assert cfg.service.address == "b:2"  # env beats file
    assert cfg.service.timeout_s == 7  # file kept where nothing overrides
    assert cfg.client.micro_batch_size == 8  # overrides beat file
    assert cfg.client.retry.max_attempts == 6  # env values are parsed to their types


def test_the_run_input_is_the_input_section_with_the_named_uri_over_it(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("input: {uri: s3://bucket/in/, unit_rows: 50}\noutput: {uri: /tmp/out}\n")
    cfg = load_config(f, {"input": {"text_column": "body"}})
    assert run_input(cfg, None, "backfill") == cfg.input
    named = run_input(cfg, "s3://other/in/", "daily")
    assert (named.uri, named.unit_rows, named.text_column) == ("s3://other/in/", 50, "body")
    # a section without a uri is complete once the run names one (the CLI's --input)
    no_uri = load_config(None, {"output": {"uri": "/o"}, "input": {"unit_rows": 7}})
    named = run_input(no_uri, "/data", "backfill")
    assert (named.unit_rows, named.uri) == (7, "/data")
    with pytest.raises(ConfigError, match="a backfill needs an input"):
        run_input(no_uri, None, "backfill")
    with pytest.raises(ConfigError, match="a daily needs an input"):
        run_input(load_config(None, {"output": {"uri": "/o"}}), None, "daily")
    with pytest.raises(ConfigError, match=r"input\.uri: .*scheme 'gs' is not supported"):
        run_input(no_uri, "gs://b/in", "backfill")


def test_the_lease_wait_is_bounded_by_default_and_set_from_the_cli_and_env():
    assert load_config(None, {"output": {"uri": "/o"}}).output.lease_wait_s == 600
    env = {"RAYPIPE_OUTPUT__LEASE_WAIT_S": "30"}
    assert load_config(None, {"output": {"uri": "/o"}}, environ=env).output.lease_wait_s == 30


def test_unknown_keys_are_errors_naming_the_path():
    with pytest.raises(ConfigError, match=r"client\.retyr: unknown setting"):
        load_config(None, {"output": {"uri": "/o"}, "client": {"retyr": {}}})


def test_env_typos_are_errors_too():
    with pytest.raises(ConfigError, match="servce"):
        load_config(None, {"output": {"uri": "/o"}}, environ={"RAYPIPE_SERVCE__ADDRESS": "x:1"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"output": {"uri": "gs://bucket/x"}}, "scheme 'gs' is not supported"),
        ({"output": {"uri": "s3:///nobucket"}}, "has no bucket"),
        ({"output": {"uri": "/o"}, "service": {"address": "no-port"}}, "is not host:port"),
        ({"output": {"uri": "/o"}, "run_id": "../etc"}, "run_id"),
        (
            {"output": {"uri": "/o"}, "client": {"limiter": {"min_limit": 9, "max_limit": 3}}},
            "min_limit 9 > max_limit 3",
        ),
        ({"output": {"uri": "/o"}, "client": {"retry": {"max_attempts": 0}}}, "max_attempts"),
        ({"output": {"uri": "/o", "lease_wait_s": 0}}, "output.lease_wait_s"),
    ],
)
def test_bad_values_are_clear(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_run_with_no_output_anywhere_is_refused_and_a_named_one_goes_over_the_configs():
    from raypipe.commit.output import Output

    with pytest.raises(ConfigError, match="no output: name one"):
        Output.for_run(load_config(None, {}).output)
    cfg = load_config(None, {"output": {"uri": "/o", "lease_s": 7}})
    named = Output.for_run(cfg.output, "/elsewhere")
    assert (named.uri, named.settings.lease_s) == ("/elsewhere", 7)  # the section's settings kept
    with pytest.raises(ConfigError, match="scheme 'gs' is not supported"):
        Output.for_run(cfg.output, "gs://bucket/x")


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_config_is_frozen():
    cfg = load_config(None, {"output": {"uri": "/o"}})
    with pytest.raises(Exception, match="frozen"):
        cfg.output.uri = "/elsewhere"  # type: ignore[misc]


@pytest.mark.parametrize(("cpus", "expected"), [(0.0, 1), (2.0, 1), (31.0, 1), (32.0, 2), (200.0, 12)])
def test_default_max_actors_follows_the_cluster(cpus, expected):
    assert default_max_actors(cpus) == expected


def test_max_actors_is_unset_by_default_and_bounds_are_checked():
    assert load_config(None, {"output": {"uri": "/o"}}).actors.max_actors is None
    assert load_config(None, {"output": {"uri": "/o"}, "actors": {"min_actors": 3}}).actors.min_actors == 3
    with pytest.raises(ConfigError, match="min_actors 3 > max_actors 2"):
        load_config(None, {"output": {"uri": "/o"}, "actors": {"min_actors": 3, "max_actors": 2}})


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"input": {"uri": "/i", "unit_row": 5}}, "input.unit_row: unknown setting (did you mean input.unit_rows?)"),
        ({"inputs": {"uri": "/i"}}, "inputs: unknown setting (did you mean input?)"),
        ({"client": {"retry": {"max_atempts": 2}}}, "(did you mean client.retry.max_attempts?)"),
        ({"zzz": 1}, "zzz: unknown setting"),
    ],
)
def test_an_unknown_key_names_the_nearest_valid_one_on_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, {"output": {"uri": "/o"}, **overrides})
    assert says in str(e.value) and "\n" not in str(e.value)
    if "zzz" in says:
        assert "did you mean" not in str(e.value)

"""A replica on a CPU with no record measures itself in the background (`serve_app.self_measure`).

The measurement is faked (a record written by hand, as `measure_in_child` would return it), so
the rule is checked without timing anything: the replica switches only among settings with the
reference's answers, only on a win beyond the spread, and its model version never changes.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from serve_app.model import cpu_flags
from serve_app.runtimes import Measurement, RuntimeRecord, Serving, cpu_key, read_record
from serve_app.self_measure import SelfMeasure
from serve_app.settings import ServerSettings

AMX = frozenset({"avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"})
DEFAULT = Serving("openvino", "fp32", reason="auto: no measured record for this CPU", unmeasured=True)


def _m(runtime: str, precision: str, rate: float, spread: float = 2.0) -> Measurement:
    return Measurement(
        runtime,
        precision,
        para_per_s=rate,
        agreement=1.0,
        max_abs_dp=0.0,
        agreement_in=1.0,
        agreement_out=1.0,
        n_in=1000,
        n_out=1000,
        spread=spread,
        rounds=5,
    )


def _record(*measurements: Measurement, flags: frozenset[str] = AMX) -> RuntimeRecord:
    return RuntimeRecord(saved_model="abc", measurements=measurements, cpu_flags=cpu_key(flags))


def _run(record: RuntimeRecord, serving: Serving = DEFAULT) -> tuple[Serving, list[str]]:
    switched: list[str] = []
    measure = SelfMeasure(
        "/nowhere",
        serving,
        ServerSettings(),
        switch=lambda s: switched.append(s.setting),
        flags=AMX,
        measure=lambda _: record,
    )
    return measure.run(), switched


def test_a_clear_win_among_equal_answer_settings_switches() -> None:
    served, switched = _run(_record(_m("tensorflow", "fp32", 120), _m("openvino", "fp32", 100)))
    assert switched == ["tensorflow:fp32"] and served.setting == "tensorflow:fp32"
    assert served.version_suffix == DEFAULT.version_suffix == ""


def test_a_tie_keeps_the_default() -> None:
    served, switched = _run(_record(_m("tensorflow", "fp32", 104, spread=5), _m("openvino", "fp32", 100, spread=5)))
    assert switched == [] and served == DEFAULT


def test_a_faster_setting_that_changes_answers_is_never_switched_to() -> None:
    # Even passing the gate: a replica switching to bf16 by itself would change the model version
    # mid-run, so answer reuse would see two versions from one deployment.
    bf16 = _m("openvino", "bf16", 300)
    served, switched = _run(_record(_m("tensorflow", "fp32", 100), _m("openvino", "fp32", 110), bf16))
    assert switched == [] and served == DEFAULT


def test_a_failed_measurement_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    def fail(_: Path) -> RuntimeRecord:
        raise OSError("no space left")

    switched: list[Serving] = []
    measure = SelfMeasure("/nowhere", DEFAULT, ServerSettings(), switch=switched.append, flags=AMX, measure=fail)
    with caplog.at_level(logging.WARNING, logger="serve_app.self_measure"):
        measure.start().join(timeout=30)
    assert switched == [] and "openvino:fp32 stays" in caplog.text


@pytest.mark.parametrize(
    ("serving", "settings", "openvino", "wanted"),
    [
        (DEFAULT, {}, True, True),
        (DEFAULT, {"measure_unrecorded": False}, True, False),
        (DEFAULT, {"runtime": "openvino"}, True, False),  # nothing else with equal answers to switch to
        (Serving("tensorflow", "fp32", "auto: no record", unmeasured=True), {}, False, False),  # no OpenVINO
        (Serving("openvino", "fp32", "auto: fastest measured"), {}, True, False),  # a record decided
    ],
)
def test_which_replicas_measure_themselves(serving: Serving, settings: dict, openvino: bool, wanted: bool) -> None:
    chosen = SelfMeasure.wanted(serving, ServerSettings.from_dict(settings), flags=AMX, openvino=openvino)
    assert chosen is wanted


def test_a_replica_without_a_record_starts_at_the_default_then_switches_in_the_background(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica itself (no Ray): it serves OpenVINO fp32 at once, the background measurement
    (faked: TensorFlow fp32 clearly faster) switches it, and its version stays."""
    from serve_app import self_measure
    from serve_app.app import EmotionClassifier

    model_dir = tmp_path / "model"
    shutil.copytree(demo_model_dir, model_dir, ignore=shutil.ignore_patterns("runtimes.json"))
    measured: list[Path] = []

    def fake_measure(directory: Path, *, threads: int) -> RuntimeRecord:
        measured.append(directory)
        return _record(_m("tensorflow", "fp32", 500), _m("openvino", "fp32", 300), flags=cpu_flags())

    monkeypatch.setattr(self_measure, "measure_in_child", fake_measure)
    replica = EmotionClassifier.func_or_class(str(model_dir), {})
    assert replica._self_measure is not None
    replica._self_measure.join(timeout=300)
    assert measured == [model_dir]
    assert replica._setting == "tensorflow:fp32"
    assert replica._version == replica._model.card.version  # fp32 on either runtime: the same answers
    assert replica._model.predict(["a calm and happy day"]).probabilities.shape == (1, len(replica._labels))
    assert read_record(model_dir) is None  # the fake wrote nothing; the child writes the record


def test_a_replica_with_a_record_does_not_measure(demo_model_dir: Path, tmp_path: Path) -> None:
    from serve_app.app import EmotionClassifier
    from serve_app.compiled import saved_model_digest
    from serve_app.runtimes import write_record

    model_dir = tmp_path / "model"
    shutil.copytree(demo_model_dir, model_dir, ignore=shutil.ignore_patterns("runtimes.json"))
    record = _record(_m("tensorflow", "fp32", 100), _m("openvino", "fp32", 130), flags=cpu_flags())
    write_record(
        model_dir, RuntimeRecord(saved_model_digest(model_dir / "saved_model"), record.measurements, record.cpu_flags)
    )
    replica = EmotionClassifier.func_or_class(str(model_dir), {})
    assert replica._self_measure is None and replica._setting == "openvino:fp32"


def test_the_child_measures_the_equal_answer_settings_and_writes_the_record(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    from serve_app.self_measure import measure_in_child

    model_dir = tmp_path / "model"
    shutil.copytree(demo_model_dir, model_dir, ignore=shutil.ignore_patterns("runtimes.json"))
    record = measure_in_child(model_dir, threads=1)
    assert {m.setting for m in record.measurements} == {("tensorflow", "fp32"), ("openvino", "fp32")}
    assert all(m.rounds == 5 and m.agreement == 1.0 for m in record.measurements)
    assert read_record(model_dir) == record  # for the next start

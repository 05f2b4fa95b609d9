"""Unit tests for the runtime x precision choice and the agreement gate (`serve_app.runtimes`).

Records are written by hand (fakes of what ``raypipe model optimize`` measures), so every CPU
class can be checked on this one: AVX2 only, VNNI only, AVX512_BF16, AMX.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from serve_app.compiled import DEFAULT_RECHECK_MARGIN, RECHECK_BASES, RECHECK_MARGINS
from serve_app.model import ModelDirError
from serve_app.runtimes import (
    GateError,
    Measurement,
    RuntimeRecord,
    Serving,
    agreement_lower_bound,
    choose,
    cpu_key,
    read_record,
    read_records,
    resolve,
    served_version,
    supported_settings,
    write_record,
)
from serve_app.settings import ServerSettings

AVX2 = frozenset({"avx", "avx2", "fma"})
VNNI = AVX2 | {"avx512f", "avx512_vnni"}
BF16 = VNNI | {"avx512_bf16"}
AMX = BF16 | {"amx_bf16", "amx_int8", "amx_tile"}


def _m(
    runtime: str,
    precision: str,
    rate: float,
    agreement: float,
    outside: float | None = None,
    n: int = 5000,
    margin: float | None = None,
) -> Measurement:
    """A measurement on ``n`` texts in and out of domain; ``outside`` (out-of-domain agreement)
    defaults to the in-domain figure."""
    outside = agreement if outside is None else outside
    return Measurement(
        runtime,
        precision,
        para_per_s=rate,
        agreement=min(agreement, outside),
        max_abs_dp=0.0,
        speedup=rate / 10,
        agreement_in=agreement,
        agreement_out=outside,
        n_in=n,
        n_out=n,
        margin=margin,
    )


def _record(*measurements: Measurement, saved_model: str = "abc", flags: frozenset[str] = BF16) -> RuntimeRecord:
    return RuntimeRecord(
        saved_model=saved_model,
        measurements=(_m("tensorflow", "fp32", 10, 1.0), *measurements),
        cpu_flags=cpu_key(flags),
    )


# Figures in the shape DESIGN.md's measurements have: OpenVINO fp32 1.3x at 100%, bf16 2.4x at
# 99.4%, int8 3.2x at 95%.
_FIGURES = (
    _m("openvino", "fp32", 13, 1.0),
    _m("openvino", "bf16", 24, 0.994),
    _m("openvino", "int8", 32, 0.95),
    _m("tensorflow", "bf16", 14, 0.995),
)


def _choose(
    precision: str, flags: frozenset[str], record: RuntimeRecord | str | None = "measured", **kw: object
) -> Serving:
    """`choose` on a CPU with ``flags``; the default record is one measured on that CPU class."""
    if record == "measured":
        record = _record(*_FIGURES, flags=flags)
    args: dict[str, object] = {"runtime": "auto", "saved_model": "abc", "min_agreement": 0.99, "force": False}
    args.update(kw)
    return choose(precision=precision, flags=flags, record=record, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (AVX2, ("openvino", "fp32")),
        (VNNI, ("openvino", "fp32")),
        (BF16, ("openvino", "bf16")),
        (AMX, ("openvino", "bf16")),
    ],
)
def test_with_a_record_auto_serves_the_fastest_setting_that_passes_the_gate(
    flags: frozenset[str], expected: tuple[str, str]
) -> None:
    # int8 is fastest everywhere but under 99%; bf16 only where the CPU has native bf16.
    chosen = _choose("auto", flags)
    assert (chosen.runtime, chosen.precision) == expected
    assert chosen.reason.startswith("auto: fastest measured")


def test_the_defaults_are_auto_so_the_serve_path_is_fast_with_no_flag() -> None:
    settings = ServerSettings()
    assert (settings.runtime, settings.precision) == ("auto", "auto")


def test_auto_picks_int8_when_it_passes_and_is_fastest() -> None:
    record = _record(_m("openvino", "fp32", 13, 1.0), _m("openvino", "int8", 32, 0.993), flags=VNNI)
    assert (_choose("auto", VNNI, record).runtime, _choose("auto", VNNI, record).precision) == ("openvino", "int8")
    # A stricter gate drops it again.
    assert _choose("auto", VNNI, record, min_agreement=0.995).precision == "fp32"


def test_the_gate_takes_the_worse_of_in_and_out_of_domain() -> None:
    # bf16 agrees 99.8% on the user's text but 98.9% on the shipped out-of-domain prose: refused.
    record = _record(_m("openvino", "fp32", 13, 1.0), _m("openvino", "bf16", 24, 0.998, outside=0.989))
    chosen = _choose("auto", BF16, record)
    assert (chosen.runtime, chosen.precision) == ("openvino", "fp32")
    with pytest.raises(GateError, match=r"99\.80% in domain, 98\.90% out of domain"):
        _choose("bf16", BF16, record)


def test_the_gate_compares_a_lower_confidence_bound_not_the_point_figure() -> None:
    # 990 of 1,000 out of domain is 99.0% measured, but the next 1,000 texts agree on fewer than
    # 99% about half the time: refused. The same 99.5% passes on 5,000 texts, not on 1,000.
    edge = _record(_m("openvino", "fp32", 13, 1.0), _m("openvino", "bf16", 24, 0.998, outside=0.990, n=1000))
    assert _choose("auto", BF16, edge).setting == "openvino:fp32"
    with pytest.raises(GateError, match=r"at least 98\.3\d% at 95% confidence, on 1000 and 1000 texts"):
        _choose("bf16", BF16, edge)
    for n, served in ((5000, "openvino:bf16"), (1000, "openvino:fp32")):
        record = _record(_m("openvino", "fp32", 13, 1.0), _m("openvino", "bf16", 24, 0.995, n=n))
        assert _choose("auto", BF16, record).setting == served
    # An equal-answer setting passes on its figure: a tie broken the other way is not a change.
    assert _m("openvino", "fp32", 13, 0.999, n=1000).passes(0.99)


@pytest.mark.parametrize(
    ("agreed", "n", "bound"),
    # Wilson score lower bounds at z = 1.645 (statsmodels' proportion_confint(k, n, alpha=0.1,
    # method="wilson")[0] gives the same figures).
    [(990, 1000, 0.98334), (996, 1000, 0.99112), (1000, 1000, 0.99730), (418, 420, 0.98571), (4975, 5000, 0.99307)],
)
def test_agreement_lower_bound_is_wilsons(agreed: int, n: int, bound: float) -> None:
    assert agreement_lower_bound(agreed / n, n) == pytest.approx(bound, abs=1e-5)
    assert agreement_lower_bound(agreed / n, None) == 0.0  # no count: no evidence


def test_a_setting_that_changes_answers_needs_an_out_of_domain_figure() -> None:
    # A record of the older format measured in domain only: bf16 is not picked unmeasured.
    old = Measurement("openvino", "bf16", para_per_s=24, agreement=0.999, max_abs_dp=0.01, agreement_in=0.999)
    record = _record(_m("openvino", "fp32", 13, 1.0), old)
    assert _choose("auto", BF16, record).precision == "fp32"


def test_with_no_record_a_replica_serves_the_fastest_setting_with_the_references_answers() -> None:
    for flags in (AVX2, VNNI, BF16, AMX):
        chosen = _choose("auto", flags, record=None)
        assert (chosen.runtime, chosen.precision) == ("openvino", "fp32")
        assert chosen.version_suffix == ""  # the reference's answers: the version of TensorFlow fp32
        assert "no measured record" in chosen.reason
        assert chosen.unmeasured  # the replica may measure itself (serve_app.self_measure)
        assert not _choose("auto", flags).unmeasured
    # Without OpenVINO the equal-answer setting is the reference itself.
    chosen = _choose("auto", BF16, record=None, openvino=False)
    assert (chosen.runtime, chosen.precision) == ("tensorflow", "fp32")


def test_a_record_of_another_cpu_class_is_not_this_replicas() -> None:
    # A pool of mixed CPUs: the record was measured on a BF16 CPU; this replica runs on AVX2.
    measured_on_bf16 = _record(*_FIGURES, flags=BF16)
    chosen = _choose("auto", AVX2, measured_on_bf16)
    assert (chosen.runtime, chosen.precision) == ("openvino", "fp32")
    assert "no measured record" in chosen.reason
    assert _choose("auto", BF16, measured_on_bf16).precision == "bf16"


def test_auto_ignores_a_record_of_other_savedmodel_files() -> None:
    chosen = _choose("auto", BF16, saved_model="other")
    assert (chosen.runtime, chosen.precision) == ("openvino", "fp32")


def test_auto_stays_on_the_asked_runtime() -> None:
    chosen = _choose("auto", BF16, runtime="tensorflow")
    assert (chosen.runtime, chosen.precision) == ("tensorflow", "bf16")
    chosen = _choose("auto", AVX2, runtime="tensorflow")
    assert (chosen.runtime, chosen.precision) == ("tensorflow", "fp32")


def test_auto_without_openvino_installed_uses_tensorflow() -> None:
    chosen = _choose("auto", BF16, openvino=False)
    assert (chosen.runtime, chosen.precision) == ("tensorflow", "bf16")


def test_gate_refuses_a_precision_recorded_under_the_threshold() -> None:
    with pytest.raises(GateError, match=r"95\.00%.*99\.00%.*force_precision") as caught:
        _choose("int8", VNNI)
    assert (caught.value.runtime, caught.value.precision) == ("openvino", "int8")


def test_gate_serves_it_when_forced_and_says_so() -> None:
    chosen = _choose("int8", VNNI, force=True)
    assert (chosen.runtime, chosen.precision, chosen.agreement) == ("openvino", "int8", 0.95)
    assert chosen.reason.startswith("forced")
    assert chosen.version_suffix == "+ov-int8"


def test_int8_with_nothing_measured_is_refused() -> None:
    with pytest.raises(GateError, match="optimize"):
        _choose("int8", VNNI, record=None)


def test_bf16_needs_native_bf16_on_every_runtime() -> None:
    for runtime in ("tensorflow", "openvino", "auto"):
        with pytest.raises(GateError, match="AVX512_BF16"):
            _choose("bf16", VNNI, runtime=runtime)


def test_int8_is_not_a_tensorflow_setting() -> None:
    with pytest.raises(GateError, match="OpenVINO only"):
        _choose("int8", VNNI, runtime="tensorflow")


def test_explicit_precision_on_runtime_auto_takes_the_faster_measured_runtime() -> None:
    chosen = _choose("bf16", BF16)
    assert (chosen.runtime, chosen.precision) == ("openvino", "bf16")
    chosen = _choose("fp32", AVX2)
    assert (chosen.runtime, chosen.precision) == ("openvino", "fp32")
    # Nothing measured: fp32 on the equal-answer runtime that is faster (OpenVINO).
    assert _choose("fp32", AVX2, record=None).runtime == "openvino"


def test_explicit_fp32_on_tensorflow_is_the_reference_whatever_the_record() -> None:
    chosen = _choose("fp32", AVX2, runtime="tensorflow", record=_record(saved_model="abc", flags=AVX2))
    assert (chosen.runtime, chosen.precision, chosen.version_suffix) == ("tensorflow", "fp32", "")


@pytest.mark.parametrize(
    ("runtime", "precision", "suffix"),
    [
        ("tensorflow", "fp32", ""),
        ("tensorflow", "bf16", "+bf16"),
        ("openvino", "fp32", ""),
        ("openvino", "bf16", "+ov-bf16"),
        ("openvino", "int8", "+ov-int8"),
    ],
)
def test_version_suffix_names_only_settings_that_change_answers(runtime: str, precision: str, suffix: str) -> None:
    serving = Serving(runtime, precision, reason="")
    assert serving.version_suffix == suffix
    assert serving.setting == f"{runtime}:{precision}"


def test_served_version_names_a_shorter_max_length_too() -> None:
    ov = Serving("openvino", "fp32", reason="")
    bf16 = Serving("openvino", "bf16", reason="")
    assert served_version("bert-abc", ov, max_sequence_length=512, model_max=512) == "bert-abc"
    assert served_version("bert-abc", ov, max_sequence_length=128, model_max=512) == "bert-abc+len128"
    assert served_version("bert-abc", bf16, max_sequence_length=128, model_max=512) == "bert-abc+len128+ov-bf16"


def test_supported_settings_follow_the_flags() -> None:
    assert supported_settings(AVX2, openvino=False) == [("tensorflow", "fp32")]
    assert ("openvino", "bf16") not in supported_settings(VNNI, openvino=True)
    assert ("openvino", "bf16") in supported_settings(AMX, openvino=True)


def test_record_keeps_one_entry_per_cpu_class_and_a_damaged_one_names_the_file(tmp_path: Path) -> None:
    assert read_record(tmp_path, flags=BF16) is None
    on_bf16, on_avx2 = _record(*_FIGURES, flags=BF16), _record(_m("openvino", "fp32", 12, 1.0), flags=AVX2)
    write_record(tmp_path, on_bf16)
    write_record(tmp_path, on_avx2)
    assert read_record(tmp_path, flags=BF16) == on_bf16
    assert read_record(tmp_path, flags=AVX2) == on_avx2
    assert read_record(tmp_path, flags=VNNI) is None
    assert len(read_records(tmp_path)) == 2
    remeasured = _record(_m("openvino", "fp32", 14, 1.0), flags=BF16)
    write_record(tmp_path, remeasured)  # replaces that CPU's entry only
    assert read_record(tmp_path, flags=BF16) == remeasured
    assert read_record(tmp_path, flags=AVX2) == on_avx2
    (tmp_path / "runtimes.json").write_text('{"format": "raypipe-runtimes/2"}')
    with pytest.raises(ModelDirError, match=r"runtimes\.json"):
        read_record(tmp_path, flags=BF16)


def test_a_record_of_the_first_format_is_still_read(tmp_path: Path) -> None:
    import json

    v1 = {
        "format": "raypipe-runtimes/1",
        "saved_model": "abc",
        "cpu_flags": list(cpu_key(BF16)),
        "measurements": [
            {"runtime": "openvino", "precision": "bf16", "para_per_s": 24, "agreement": 0.995, "max_abs_dp": 0.01}
        ],
    }
    (tmp_path / "runtimes.json").write_text(json.dumps(v1))
    record = read_record(tmp_path, flags=BF16)
    assert record is not None
    m = record.get("openvino", "bf16")
    assert m is not None and m.agreement_in == 0.995 and m.agreement_out is None
    assert not m.passes(0.99)  # measured in domain only: not enough for a setting that changes answers


def test_a_record_written_before_the_counts_takes_them_from_its_sample(tmp_path: Path) -> None:
    write_record(tmp_path, _record(_m("openvino", "bf16", 24, 418 / 420, outside=0.996), flags=BF16))
    import json

    raw = json.loads((tmp_path / "runtimes.json").read_text())
    for m in raw["records"][0]["measurements"]:
        del m["n_in"], m["n_out"]
    raw["records"][0]["sample"] = {"held_out": 420, "out_of_domain": 1000}
    (tmp_path / "runtimes.json").write_text(json.dumps(raw))
    record = read_record(tmp_path, flags=BF16)
    assert record is not None
    m = record.get("openvino", "bf16")
    assert m is not None and (m.n_in, m.n_out) == (420, 1000)
    assert not m.passes(0.99)  # 418 of 420 in domain: at least 98.6% at 95% confidence


def test_a_record_written_before_rounds_were_kept_compares_by_its_figure(tmp_path: Path) -> None:
    import json

    write_record(tmp_path, _record(*_FIGURES, flags=BF16))
    raw = json.loads((tmp_path / "runtimes.json").read_text())
    for m in raw["records"][0]["measurements"]:
        del m["spread"], m["rounds"]
    (tmp_path / "runtimes.json").write_text(json.dumps(raw))
    record = read_record(tmp_path, flags=BF16)
    assert record is not None and all((m.spread, m.rounds) == (0.0, 0) for m in record.measurements)
    assert _choose("auto", BF16, record).setting == "openvino:bf16"  # the fastest that passes, as before


def test_resolve_reads_the_record_beside_the_model(tmp_path: Path) -> None:
    saved = tmp_path / "saved_model"
    saved.mkdir()
    (saved / "saved_model.pb").write_bytes(b"weights")
    from serve_app.compiled import saved_model_digest

    record = _record(_m("openvino", "int8", 32, 0.95), saved_model=saved_model_digest(saved), flags=VNNI)
    write_record(tmp_path, record)
    with pytest.raises(GateError, match="int8"):
        resolve(tmp_path, ServerSettings(precision="int8", runtime="openvino"), flags=VNNI)
    forced = resolve(tmp_path, ServerSettings(precision="int8", runtime="openvino", force_precision=True), flags=VNNI)
    assert forced.precision == "int8"
    assert forced.version_suffix == "+ov-int8"  # no int8 build here: the loader will say so
    # The SavedModel changes: the record no longer speaks for it; the equal-answer setting is served.
    (saved / "saved_model.pb").write_bytes(b"retrained")
    assert resolve(tmp_path, ServerSettings(), flags=VNNI).setting == "openvino:fp32"


def test_settings_reject_unknown_runtime_and_bad_threshold() -> None:
    with pytest.raises(ValueError, match="runtime"):
        ServerSettings(runtime="onnx")
    with pytest.raises(ValueError, match="min_agreement"):
        ServerSettings(min_agreement=1.5)
    assert ServerSettings.from_dict({"runtime": "openvino", "force_precision": True}).runtime == "openvino"


def test_two_int8_builds_never_share_a_version(tmp_path: Path) -> None:
    """An int8 IR's weights depend on the texts it was calibrated on: the version names the build,
    so answer reuse never takes one build's answers for another's."""
    saved = tmp_path / "saved_model"
    saved.mkdir()
    (saved / "saved_model.pb").write_bytes(b"weights")
    from serve_app.compiled import saved_model_digest

    write_record(tmp_path, _record(_m("openvino", "int8", 32, 1.0), saved_model=saved_model_digest(saved), flags=VNNI))
    ir = tmp_path / "openvino"
    ir.mkdir()
    (ir / "int8.xml").write_text("<net/>")
    settings = ServerSettings(precision="int8", runtime="openvino")

    def version() -> str:
        return served_version("bert-abc", resolve(tmp_path, settings, flags=VNNI), max_sequence_length=64, model_max=64)

    (ir / "int8.bin").write_bytes(b"calibrated on the demo texts")
    first = version()
    assert first.startswith("bert-abc+ov-int8-") and first == version()
    (ir / "int8.bin").write_bytes(b"calibrated on the user's texts")
    assert version() not in (first, "bert-abc+ov-int8")


# -- the precision candidates between fp32 and bf16 (serve_app.compiled.BF16_PRECISIONS) --------

CANDIDATES = ("bf16-dense", "bf16-ffn", "bf16-recheck", "bf16-dense-recheck")


@pytest.mark.parametrize("flags", [AVX2, VNNI, BF16, AMX])
def test_a_candidate_is_offered_only_where_the_cpu_has_native_bf16(flags: frozenset[str]) -> None:
    native = "avx512_bf16" in flags
    offered = {p for r, p in supported_settings(flags, openvino=True) if r == "openvino" and p in CANDIDATES}
    assert offered == (set(CANDIDATES) if native else set())
    assert not {p for _, p in supported_settings(flags, openvino=False)} & set(CANDIDATES)
    for precision in CANDIDATES:
        if native:
            assert _choose(precision, flags, record=None, runtime="openvino").precision == precision
        else:
            with pytest.raises(GateError, match="AVX512_BF16"):
                _choose(precision, flags, record=None)
        with pytest.raises(GateError, match="OpenVINO only"):
            _choose(precision, BF16, record=None, runtime="tensorflow")


def test_auto_serves_the_fastest_candidate_through_the_gate_and_refuses_one_under_it() -> None:
    # bf16 and bf16-dense are faster, but under the gate (99.0% out of domain on 1,000 texts is
    # a lower bound of 98.3%); bf16-recheck agrees on every text and is faster than bf16-ffn.
    record = _record(
        _m("openvino", "fp32", 13, 1.0),
        _m("openvino", "bf16", 31, 0.998, outside=0.990, n=1000),
        _m("openvino", "bf16-dense", 29, 0.995, outside=0.990, n=1000),
        _m("openvino", "bf16-ffn", 24, 0.999, n=1000),
        _m("openvino", "bf16-recheck", 27, 1.0, n=1000),
        flags=AMX,
    )
    chosen = _choose("auto", AMX, record)
    assert chosen.setting == "openvino:bf16-recheck"
    assert chosen.version_suffix == "+ov-bf16-recheck-m0.05"  # measured without a margin: the default one
    with pytest.raises(GateError, match=r"99\.50% in domain, 99\.00% out of domain") as caught:
        _choose("bf16-dense", AMX, record)
    assert (caught.value.runtime, caught.value.precision) == ("openvino", "bf16-dense")
    # Where no candidate passes, fp32's answers.
    passing = ("bf16-ffn", "bf16-recheck")
    refused = _record(*(m for m in record.measurements[1:] if m.precision not in passing), flags=AMX)
    assert _choose("auto", AMX, refused).setting == "openvino:fp32"


def test_each_candidate_answers_under_a_version_of_its_own() -> None:
    servings = [Serving("openvino", p, reason="") for p in ("fp32", "bf16", "bf16-dense", "bf16-ffn")]
    servings += [Serving("openvino", p, reason="", margin=m) for p in RECHECK_BASES for m in RECHECK_MARGINS]
    suffixes = [s.version_suffix for s in servings]
    assert suffixes[0] == ""
    assert len(set(suffixes)) == len(suffixes)
    assert all(s.startswith("+ov-bf16") for s in suffixes[1:])
    assert served_version("m", Serving("openvino", "bf16-ffn", reason=""), max_sequence_length=8, model_max=8) == (
        "m+ov-bf16-ffn"
    )


def test_settings_take_the_candidates_by_name() -> None:
    for precision in CANDIDATES:
        assert ServerSettings(precision=precision).precision == precision
    with pytest.raises(ValueError, match="bf16-recheck"):
        ServerSettings(precision="bf16-half")


# -- bf16-recheck's margin: a ladder the gate chooses from ----------------------------------------


def _ladder(*figures: tuple[float, float, float, float]) -> RuntimeRecord:
    """A record with OpenVINO fp32 and bf16-recheck at each (margin, para/s, in, out) of ``figures``,
    on 900 texts in and 1,000 out of domain."""
    rechecks = []
    for margin, rate, inside, outside in figures:
        m = _m("openvino", "bf16-recheck", rate, inside, outside=outside, n=900, margin=margin)
        rechecks.append(replace(m, n_out=1000))
    return _record(_m("openvino", "fp32", 13, 1.0), *rechecks, flags=AMX)


def test_the_ladder_serves_the_fastest_margin_that_passes_the_gate() -> None:
    # 0.05 is fastest but flips 9 of 900 texts in domain (lower bound 98.3%): refused. 0.1 and 0.2
    # pass; 0.1 is faster beyond the spread, so it is served, and its margin names the version.
    record = _ladder((0.05, 40, 0.99, 0.998), (0.1, 34, 0.998, 0.999), (0.2, 24, 1.0, 1.0))
    chosen = _choose("auto", AMX, record)
    assert (chosen.setting, chosen.margin) == ("openvino:bf16-recheck", 0.1)
    assert chosen.version_suffix == "+ov-bf16-recheck-m0.1"
    assert "margin 0.1" in chosen.reason
    # Asked for by name, the same margin.
    assert _choose("bf16-recheck", AMX, record).margin == 0.1
    # A margin under the gate is refused even where it alone is measured.
    only_fast = _ladder((0.05, 40, 0.99, 0.998))
    assert _choose("auto", AMX, only_fast).setting == "openvino:fp32"
    with pytest.raises(GateError, match=r"at margin 0\.05, .*99\.00% in domain"):
        _choose("bf16-recheck", AMX, only_fast)
    forced = _choose("bf16-recheck", AMX, only_fast, force=True)
    assert (forced.margin, forced.reason.startswith("forced")) == (0.05, True)


def test_passing_margins_of_one_precision_serve_the_narrowest_whatever_the_noise_says() -> None:
    # A wider margin reruns a superset of the rows: the narrowest passing one is the fastest by
    # construction, even where noisy rounds timed the wider one as fast or faster.
    record = _ladder((0.05, 40, 0.99, 0.998), (0.1, 30, 0.998, 0.999), (0.2, 31, 1.0, 1.0))
    record = replace(record, measurements=tuple(replace(m, spread=8.0, rounds=5) for m in record.measurements))
    assert _choose("auto", AMX, record).margin == 0.1  # 0.05 fails the gate; 0.1 is the narrowest passing
    assert _choose("bf16-recheck", AMX, record).margin == 0.1


def test_recheck_precisions_that_tie_within_the_spread_keep_the_higher_gate_figure() -> None:
    ladder = _ladder((0.07, 30, 0.998, 0.999))
    dense = replace(
        ladder.all("openvino", "bf16-recheck")[0], precision="bf16-dense-recheck", para_per_s=31.0, agreement_in=0.996
    )
    record = replace(
        ladder, measurements=tuple(replace(m, spread=3.0, rounds=5) for m in [*ladder.measurements, dense])
    )
    chosen = _choose("auto", AMX, record)
    assert (chosen.precision, chosen.margin) == ("bf16-recheck", 0.07)
    others = [m for m in record.measurements if m.precision != "bf16-dense-recheck"]
    clear = replace(record, measurements=(*others, replace(dense, para_per_s=40.0, spread=1.0)))
    assert _choose("auto", AMX, clear).precision == "bf16-dense-recheck"


def test_a_recheck_margin_survives_the_record_file(tmp_path: Path) -> None:
    record = _ladder((0.05, 40, 0.99, 0.998), (0.1, 34, 0.998, 0.999))
    write_record(tmp_path, record)
    again = read_record(tmp_path, flags=AMX)
    assert again is not None
    assert [m.margin for m in again.all("openvino", "bf16-recheck")] == [0.05, 0.1]
    assert _choose("auto", AMX, again).margin == 0.1


def test_a_record_from_before_the_ladder_reads_as_the_margin_it_was_measured_at(tmp_path: Path) -> None:
    raw = _record(_m("openvino", "bf16-recheck", 27, 1.0), flags=AMX).to_json()
    for m in raw["measurements"]:
        del m["margin"]
    again = RuntimeRecord.from_json(raw)
    assert [m.margin for m in again.all("openvino", "bf16-recheck")] == [0.05]
    assert again.get("tensorflow", "fp32") is not None and again.get("tensorflow", "fp32").margin is None


def test_a_margin_goes_with_bf16_recheck_only() -> None:
    with pytest.raises(ValueError, match="margin"):
        Serving("openvino", "bf16", reason="", margin=0.1)
    with pytest.raises(ValueError, match="margin"):
        Serving("openvino", "bf16-recheck", reason="")
    # Unmeasured, asked for by name: the default margin.
    assert _choose("bf16-recheck", AMX, record=None, runtime="openvino").margin == DEFAULT_RECHECK_MARGIN

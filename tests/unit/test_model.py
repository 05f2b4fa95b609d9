"""Unit tests for the served model: model-directory validation, length-sorted chunked
prediction, truncation, precision choice, and the offline demo model's quality."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from serve_app import demo_data, demo_model
from serve_app.demo_model import build_demo_model, recipe_fingerprint
from serve_app.model import (
    PASS_COST_TOKENS,
    EmotionModel,
    ModelCard,
    ModelDirError,
    Tokenized,
    configure_precision,
    configure_tf_threads,
    cut_sorted,
    padded_length,
    read_model_card,
)

GOOD_CARD = {
    "format": "raypipe-model/1",
    "labels": list(demo_data.LABELS),
    "version": "test-1",
    "max_sequence_length": 128,
}

# Written for these tests, not taken from the demo templates (test_sentences_are_unseen
# checks that they do not occur in the training data). One per label, in LABELS order.
HAND_WRITTEN = (
    "My dog died last week and I still cry every time I see his empty bowl.",
    "I passed my driving test on the first try and I'm so happy!",
    "I love spending quiet Sunday mornings cuddled up with my girlfriend.",
    "I am so angry that my boss yelled at me in front of the whole team.",
    "I'm scared to death of flying and my hands shake before every flight.",
    "I was shocked when my quiet neighbour turned out to be a famous singer.",
)

MIXED_LENGTHS = [
    "Fine.",
    "I can't believe they cancelled the concert without telling anyone.",
    " ".join(text for text, _ in demo_data.paragraphs(12, seed=7)),  # several hundred tokens
    "We hugged for a long time at the station.",
    "",
    "The report is due on Friday. " * 12,
    "ok " * 40,
    "Honestly I have no idea what to feel about any of this, it is all so strange. " * 3,
]


@pytest.fixture(scope="module")
def model(demo_model_dir: Path) -> EmotionModel:
    return EmotionModel.load(demo_model_dir)


def _write_card(model_dir: Path, card: object) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "model.json"
    path.write_text(json.dumps(card), encoding="utf-8")
    return path


def _linked_copy(demo_model_dir: Path, target: Path, *, skip: str = "") -> Path:
    """A model dir whose parts link to the demo model's, so one part can be replaced."""
    target.mkdir()
    for part in ("model.json", "saved_model", "tokenizer"):
        if part != skip:
            (target / part).symlink_to(demo_model_dir / part)
    return target


# --- model.json ------------------------------------------------------------------------


def test_read_model_card_parses_a_valid_card(tmp_path: Path) -> None:
    _write_card(tmp_path, {**GOOD_CARD, "fingerprint": "abc"})
    card = read_model_card(tmp_path)
    assert card == ModelCard(labels=demo_data.LABELS, version="test-1", max_sequence_length=128)


def test_missing_model_dir_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelDirError, match="does not exist") as e:
        read_model_card(missing)
    assert e.value.path == missing
    assert str(missing) in str(e.value)


def test_missing_model_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"missing model\.json") as e:
        read_model_card(tmp_path)
    assert str(tmp_path / "model.json") in str(e.value)


@pytest.mark.parametrize(
    ("card", "message"),
    [
        ({k: v for k, v in GOOD_CARD.items() if k != "labels"}, "labels"),
        ({k: v for k, v in GOOD_CARD.items() if k != "version"}, "version"),
        ({**GOOD_CARD, "format": "something-else/2"}, "format"),
        ({**GOOD_CARD, "labels": []}, "labels"),
        ({**GOOD_CARD, "labels": "joy"}, "labels"),
        ({**GOOD_CARD, "labels": ["joy", "joy"]}, "unique"),
        ({**GOOD_CARD, "labels": ["joy", 3]}, "labels"),
        ({**GOOD_CARD, "version": ""}, "version"),
        ({**GOOD_CARD, "max_sequence_length": 0}, "max_sequence_length"),
        ({**GOOD_CARD, "max_sequence_length": True}, "max_sequence_length"),
        ({**GOOD_CARD, "max_sequence_length": "128"}, "max_sequence_length"),
        (["not", "an", "object"], "JSON object"),
    ],
)
def test_bad_model_card_names_file_and_problem(tmp_path: Path, card: object, message: str) -> None:
    path = _write_card(tmp_path, card)
    with pytest.raises(ModelDirError, match=message) as e:
        read_model_card(tmp_path)
    assert e.value.path == path
    assert str(path) in str(e.value)


def test_unparseable_model_json(tmp_path: Path) -> None:
    (tmp_path / "model.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelDirError, match=r"cannot read model\.json"):
        read_model_card(tmp_path)


# --- loading ----------------------------------------------------------------------------


@pytest.mark.parametrize("junk", ["empty", "garbage_config"])
def test_bad_tokenizer_dir_is_named(demo_model_dir: Path, tmp_path: Path, junk: str) -> None:
    model_dir = _linked_copy(demo_model_dir, tmp_path / "m", skip="tokenizer")
    tokenizer_dir = model_dir / "tokenizer"
    tokenizer_dir.mkdir()
    if junk == "garbage_config":
        (tokenizer_dir / "tokenizer_config.json").write_text("{broken", encoding="utf-8")
    with pytest.raises(ModelDirError) as e:
        EmotionModel.load(model_dir)
    assert e.value.path == tokenizer_dir
    assert str(tokenizer_dir) in str(e.value)


@pytest.mark.parametrize("part", ["tokenizer", "saved_model"])
def test_missing_part_is_named(demo_model_dir: Path, tmp_path: Path, part: str) -> None:
    model_dir = _linked_copy(demo_model_dir, tmp_path / "m", skip=part)
    with pytest.raises(ModelDirError, match=f"missing {part}") as e:
        EmotionModel.load(model_dir)
    assert e.value.path == model_dir / part


def test_label_count_must_match_model_output(demo_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _linked_copy(demo_model_dir, tmp_path / "m", skip="model.json")
    _write_card(model_dir, {**GOOD_CARD, "labels": [*demo_data.LABELS, "boredom"]})
    with pytest.raises(ModelDirError, match=r"6 classes but model\.json lists 7") as e:
        EmotionModel.load(model_dir)
    assert e.value.path == model_dir / "saved_model"


def test_demo_card_matches_recipe(demo_model_dir: Path, model: EmotionModel) -> None:
    raw = json.loads((demo_model_dir / "model.json").read_text(encoding="utf-8"))
    assert raw["fingerprint"] == recipe_fingerprint(0)
    assert model.card.labels == demo_data.LABELS
    assert model.card.version.startswith("demo-bert-2x128-")
    assert model.card.max_sequence_length == 512


def test_build_is_cached(demo_model_dir: Path) -> None:
    before = (demo_model_dir / "model.json").stat().st_mtime_ns
    assert build_demo_model(demo_model_dir) == demo_model_dir
    assert (demo_model_dir / "model.json").stat().st_mtime_ns == before


def _fake_trainer(calls: list[Path]) -> Callable[..., dict[str, object]]:
    """Stands in for the training child: writes just a model.json with the fingerprint."""

    def train(tmp: Path, *, seed: int, fingerprint: str) -> dict[str, object]:
        calls.append(tmp)
        tmp.mkdir()
        (tmp / "model.json").write_text(json.dumps({"fingerprint": fingerprint}), encoding="utf-8")
        return {}

    return train


def test_rebuild_swaps_in_place_and_leaves_no_temp_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(demo_model, "_train_in_child", _fake_trainer(calls))
    out = tmp_path / "demo"
    _write_card(out, {"fingerprint": "an older recipe"})
    (tmp_path / ".demo.tmp-999").mkdir()  # left by a killed build
    assert build_demo_model(out) == out
    assert json.loads((out / "model.json").read_text())["fingerprint"] == recipe_fingerprint(0)
    assert build_demo_model(out) == out  # cached: no second training
    assert len(calls) == 1
    assert build_demo_model(out, force=True) == out
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo.lock", "demo"]


def test_failed_build_keeps_the_previous_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(tmp: Path, *, seed: int, fingerprint: str) -> dict[str, object]:
        tmp.mkdir()
        (tmp / "half-written").touch()
        raise demo_model.DemoBuildError(1, "killed")

    monkeypatch.setattr(demo_model, "_train_in_child", broken)
    out = tmp_path / "demo"
    _write_card(out, {"fingerprint": "old"})
    with pytest.raises(demo_model.DemoBuildError):
        build_demo_model(out)
    assert json.loads((out / "model.json").read_text())["fingerprint"] == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo.lock", "demo"]


# --- predict ----------------------------------------------------------------------------


def test_predictions_shape_dtype_and_normalisation(model: EmotionModel) -> None:
    out = model.predict(MIXED_LENGTHS)
    assert out.probabilities.shape == (len(MIXED_LENGTHS), 6)
    assert out.probabilities.dtype == np.float32
    assert out.truncated.shape == (len(MIXED_LENGTHS),)
    assert out.truncated.dtype == np.bool_
    np.testing.assert_allclose(out.probabilities.sum(axis=1), 1.0, atol=1e-4)
    assert (out.probabilities >= 0).all()


def test_empty_input(model: EmotionModel) -> None:
    out = model.predict([])
    assert out.probabilities.shape == (0, 6)
    assert out.probabilities.dtype == np.float32
    assert out.truncated.shape == (0,)
    assert out.truncated.dtype == np.bool_


def test_bucketed_batch_matches_one_by_one(model: EmotionModel) -> None:
    together = model.predict(MIXED_LENGTHS)
    for i, text in enumerate(MIXED_LENGTHS):
        alone = model.predict([text])
        np.testing.assert_allclose(alone.probabilities[0], together.probabilities[i], atol=1e-5)
        assert alone.truncated[0] == together.truncated[i]


def test_rows_come_back_in_input_order_across_chunks(demo_model_dir: Path) -> None:
    # A budget of one max-length row forces many chunks per bucket.
    small = EmotionModel.load(demo_model_dir, token_budget=512)
    texts = [text for text, _ in demo_data.paragraphs(90, seed=3)] + MIXED_LENGTHS
    forward = small.predict(texts).probabilities
    backward = small.predict(texts[::-1]).probabilities
    np.testing.assert_allclose(forward, backward[::-1], atol=1e-5)
    np.testing.assert_allclose(forward[-1], small.predict([texts[-1]]).probabilities[0], atol=1e-5)


def test_token_budget_must_hold_one_full_row(demo_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="token_budget"):
        EmotionModel.load(demo_model_dir, token_budget=100)


def test_truncation_flags(model: EmotionModel) -> None:
    long_text = "I waited at the station for hours. " * 200  # ~1,400 tokens
    huge_text = "joy " * 2_000_000  # 8 MB: cut by characters before tokenizing
    one_word = "x" * 100_000  # a single over-long "word": one [UNK] token, but still cut
    out = model.predict(["Short and sweet.", long_text, huge_text, "", one_word])
    assert out.truncated.tolist() == [False, True, True, False, True]


def test_truncation_boundary(demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir / "tokenizer", local_files_only=True)  # type: ignore[no-untyped-call, unused-ignore]
    assert len(tokenizer("happy happy")["input_ids"]) == 4  # [CLS] happy happy [SEP]
    small = EmotionModel.load(demo_model_dir, max_sequence_length=32)
    fits = " ".join(["happy"] * 30)  # 30 + 2 special tokens = 32
    out = small.predict([fits, fits + " happy"])
    assert out.truncated.tolist() == [False, True]


def test_max_sequence_length_can_be_lowered(demo_model_dir: Path, model: EmotionModel) -> None:
    short = EmotionModel.load(demo_model_dir, max_sequence_length=64)
    assert short.card.max_sequence_length == 64
    texts = ["We hugged for a long time at the station.", "The report is due on Friday. " * 20]
    out = short.predict(texts)
    assert out.truncated.tolist() == [False, True]
    # A text that fits gets the same answer as from the full-length model.
    np.testing.assert_allclose(out.probabilities[0], model.predict(texts[:1]).probabilities[0], atol=1e-5)


def test_max_sequence_length_cannot_be_raised(demo_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="exceeds"):
        EmotionModel.load(demo_model_dir, max_sequence_length=513)


def test_warmup_runs(model: EmotionModel) -> None:
    model.warmup()


def test_padded_length_rounds_up_to_a_multiple_of_8_within_the_maximum() -> None:
    assert [padded_length(n, 512) for n in (1, 8, 9, 42, 64, 65, 509, 512)] == [8, 8, 16, 48, 64, 72, 512, 512]
    assert padded_length(99, 100) == 100


def test_chunks_pad_to_their_longest_row_and_keep_the_budget(demo_model_dir: Path) -> None:
    small = EmotionModel.load(demo_model_dir, token_budget=512)
    lengths = [5, 300, 17, 60, 61, 9, 512, 40, 33, 120] * 7
    tokenized = Tokenized(ids=[[1] * n for n in lengths], truncated=np.zeros(len(lengths), dtype=bool))
    chunks = small.chunks(tokenized)
    assert sorted(i for c in chunks for i in c.rows.tolist()) == list(range(len(lengths)))
    for c in chunks:
        longest = max(lengths[i] for i in c.rows)
        assert c.length == padded_length(longest, 512)
        assert c.padded_tokens <= 512
    # Sorted by length: a chunk never mixes a short row with a much longer one when the
    # budget would have let the short row go with rows like it.
    assert sum(c.padded_tokens for c in chunks) <= 1.35 * sum(lengths)


def _greedy(padded: list[int], budget: int) -> list[tuple[int, int]]:
    """Each chunk as full as the budget allows (the cut before `cut_sorted`)."""
    ranges, start = [], 0
    for stop in range(1, len(padded) + 1):
        if stop == len(padded) or (stop - start + 1) * padded[stop] > budget:
            ranges.append((start, stop))
            start = stop
    return ranges


def _cost(padded: list[int], ranges: list[tuple[int, int]], pass_cost: int) -> int:
    return sum(pass_cost + (b - a) * padded[b - 1] for a, b in ranges)


def test_passes_are_cut_where_the_lengths_jump_not_where_the_budget_is_full() -> None:
    # Greedy filling puts the 10 short rows in the long rows' pass: 15 x 128 = 1,920 tokens
    # for 800 real ones. Two passes pad 160 + 640.
    padded = [16] * 10 + [128] * 5
    assert _greedy(padded, 2048) == [(0, 15)]
    assert cut_sorted(np.array(padded), 2048) == [(0, 10), (10, 15)]
    # A pass costs PASS_COST_TOKENS: 3 rows x 8 tokens of padding do not pay for one.
    assert cut_sorted(np.array([16] * 3 + [24]), 2048) == [(0, 4)]
    assert cut_sorted(np.array([16] * 5 + [24]), 2048) == [(0, 5), (5, 6)]
    assert cut_sorted(np.array([], dtype=np.int64), 2048) == []


@pytest.mark.parametrize("seed", range(5))
def test_the_cut_keeps_the_budget_and_never_costs_more_than_filling_each_pass(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = np.sort(rng.integers(1, 513, size=int(rng.integers(1, 400))))
    padded = [padded_length(int(n), 512) for n in lengths]
    ranges = cut_sorted(np.array(padded), 2048)
    assert [a for a, _ in ranges] == [0, *(b for _, b in ranges[:-1])] and ranges[-1][1] == len(padded)
    assert all(a < b and (b - a) * padded[b - 1] <= 2048 for a, b in ranges)
    assert _cost(padded, ranges, PASS_COST_TOKENS) <= _cost(padded, _greedy(padded, 2048), PASS_COST_TOKENS)


def test_a_batchs_chunks_run_in_any_order_give_infers_answers(model: EmotionModel) -> None:
    tokenized = model.tokenize(MIXED_LENGTHS * 3)
    probabilities = np.empty((len(tokenized), len(model.card.labels)), dtype=np.float32)
    for chunk in reversed(model.chunks(tokenized)):
        probabilities[chunk.rows] = model.run_chunk(tokenized, chunk)
    np.testing.assert_allclose(probabilities, model.infer(tokenized).probabilities, atol=1e-6)


def test_tokenize_then_infer_is_predict(model: EmotionModel) -> None:
    tokenized = model.tokenize(MIXED_LENGTHS)
    assert len(tokenized) == len(MIXED_LENGTHS)
    assert tokenized.tokens == sum(len(x) for x in tokenized.ids)
    halves = Tokenized.concat([model.tokenize(MIXED_LENGTHS[:3]), model.tokenize(MIXED_LENGTHS[3:])])
    np.testing.assert_allclose(model.infer(halves).probabilities, model.predict(MIXED_LENGTHS).probabilities, atol=1e-5)
    assert model.infer(halves).truncated.tolist() == model.predict(MIXED_LENGTHS).truncated.tolist()


@pytest.mark.parametrize(
    ("flags", "asked"),
    [({"avx512f", "avx512_bf16"}, "bf16"), ({"amx_bf16", "amx_tile"}, "bf16"), (set(), "fp32")],
)
def test_tensorflow_precision_follows_the_cpu(flags: set[str], asked: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorflow as tf

    seen: list[dict[str, bool]] = []
    monkeypatch.setattr(tf.config.optimizer, "set_experimental_options", seen.append)
    assert configure_precision(asked, frozenset(flags)) == asked
    assert seen == ([{"auto_mixed_precision_onednn_bfloat16": True}] if asked == "bf16" else [])


def test_int8_and_auto_are_not_tensorflow_precisions() -> None:
    # int8 runs on OpenVINO; auto is resolved from measured agreement (serve_app.runtimes.choose).
    for asked in ("int8", "auto"):
        with pytest.raises(ValueError, match="fp32 or bf16"):
            configure_precision(asked, frozenset({"avx512_vnni", "avx512_bf16"}))


def test_bf16_without_native_support_is_refused() -> None:
    with pytest.raises(ValueError, match="AVX512_BF16"):
        configure_precision("bf16", frozenset({"avx512f", "avx512_vnni"}))
    with pytest.raises(ValueError, match="precision"):
        configure_precision("fp16", frozenset())


def test_configure_tf_threads_after_start_warns(model: EmotionModel, caplog: pytest.LogCaptureFixture) -> None:
    # `model` has run TensorFlow, so its thread pools are fixed by now.
    import tensorflow as tf

    current = tf.config.threading.get_intra_op_parallelism_threads()
    with caplog.at_level(logging.WARNING, logger="serve_app.model"):
        configure_tf_threads(current + 1, 1)
    assert "already initialised" in caplog.text
    with pytest.raises(ValueError):
        configure_tf_threads(-1, 1)


# --- the demo model's quality -------------------------------------------------------------


def test_sentences_are_unseen() -> None:
    seen = {text for text, _ in demo_data.sentences(6000, seed=0)}
    seen |= {text for text, _ in demo_data.paragraphs(1500, seed=0)}
    assert not seen & set(HAND_WRITTEN)


def test_demo_model_understands_hand_written_sentences(model: EmotionModel) -> None:
    predicted = model.predict(HAND_WRITTEN).probabilities.argmax(axis=1)
    got = [demo_data.LABELS[i] for i in predicted]
    correct = sum(g == want for g, want in zip(got, demo_data.LABELS, strict=True))
    assert correct >= 5, f"only {correct}/6 right: {list(zip(HAND_WRITTEN, got, strict=True))}"


# --- demo data ----------------------------------------------------------------------------


def test_demo_data_is_deterministic_and_balanced() -> None:
    assert demo_data.sentences(60, seed=1) == demo_data.sentences(60, seed=1)
    assert demo_data.sentences(60, seed=1) != demo_data.sentences(60, seed=2)
    labels = [label for _, label in demo_data.sentences(60, seed=1)]
    assert all(labels.count(i) == 10 for i in range(6))
    paragraphs = demo_data.paragraphs(600, seed=1)
    assert paragraphs == demo_data.paragraphs(600, seed=1)
    words = [len(text.split()) for text, _ in paragraphs]
    assert min(words) < 10 and max(words) > 150  # a long tail, so bucketing matters


def test_a_demo_build_leaves_its_runtimes_record_so_its_replicas_do_not_measure_themselves(
    demo_model_dir, tmp_path, monkeypatch
):
    """Measured once, under the build's lock, as `raypipe model export` leaves a user's model."""
    import json
    import shutil

    from serve_app import demo_model, self_measure

    def fake_train(tmp, *, seed, fingerprint):
        shutil.copytree(demo_model_dir, tmp, ignore=shutil.ignore_patterns("runtimes.json"))
        card = json.loads((tmp / "model.json").read_text())
        (tmp / "model.json").write_text(json.dumps({**card, "fingerprint": fingerprint}))
        return "copied"

    measured = []
    monkeypatch.setattr(demo_model, "_train_in_child", fake_train)
    monkeypatch.setattr(self_measure, "measure_in_child", lambda d, *, threads: measured.append((d, threads)))
    out = demo_model.build_demo_model(tmp_path / "demo", force=True)
    assert [d for d, _ in measured] == [out] and measured[0][1] >= 1
    demo_model.build_demo_model(tmp_path / "demo")  # built already: no second measurement
    assert len(measured) == 1

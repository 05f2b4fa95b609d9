"""The trained bench model's data (`bench.models`): what it trains on and what it is measured against."""

from __future__ import annotations

from bench import models
from serve_app import demo_data
from serve_app.export.check import SAMPLE_TEXTS
from serve_app.optimize import default_sample


def test_the_trained_model_never_trains_on_a_text_the_bench_measures() -> None:
    recipe = {**models.TRAINED_RECIPE, "train_sentences": 600, "train_paragraphs": 120}
    texts, labels = models._training_texts(recipe)
    assert len(texts) == len(labels) > 600
    assert not set(texts) & set(default_sample())
    assert set(labels) == set(range(len(demo_data.LABELS)))


def test_every_generated_text_of_the_default_sample_has_its_label() -> None:
    truth = models.in_domain_labels()
    generated = [t for t in default_sample() if t not in SAMPLE_TEXTS]
    assert generated and all(t in truth for t in generated)
    assert set(truth.values()) == set(range(len(demo_data.LABELS)))


def test_batches_cover_every_row_once_in_length_order() -> None:
    lengths = [5, 1, 9, 3, 7, 2, 8]
    batches = models._batches(lengths, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [[lengths[i] for i in b] for b in batches] == [[1, 2, 3], [5, 7, 8], [9]]

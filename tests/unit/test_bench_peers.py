"""The bench's peers section (`bench.peers`): the figures of a line, the interleaving of rounds,
medians and ratios against the targets, and the tables the results file and the docs show."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from bench import docs, peers
from protos.raypipe.v1 import emotion_pb2_grpc
from tests.fakes import LABELS, FakeServicer, fake_probs


def _sample(para_per_s: float, *, n: int = 600, busy: float = 1.9) -> dict[str, object]:
    wall = n / para_per_s
    return peers.line_figures(paragraphs=n, ok=n, wall_s=wall, cpu_s=busy * wall, cores=2)


def test_a_line_is_answered_paragraphs_per_command_second_and_process_tree_cpu_per_paragraph():
    f = peers.line_figures(paragraphs=1000, ok=990, wall_s=10.0, cpu_s=19.0, cores=2)
    assert f["para_per_s"] == pytest.approx(99.0)  # failed paragraphs are not throughput
    assert f["cpu_ms_per_para"] == pytest.approx(1000 * 19.0 / 990)
    assert f["cores_busy"] == pytest.approx(1.9)
    assert f["cores_busy_share"] == pytest.approx(0.95)
    with pytest.raises(ValueError, match="positive wall"):
        peers.line_figures(paragraphs=10, ok=0, wall_s=1.0, cpu_s=1.0, cores=2)


def test_each_line_takes_each_place_in_turn_and_c_and_d_share_their_cluster():
    orders = peers.round_orders(4)
    assert all(sorted(order) == ["a", "b", "c", "d"] for order in orders)
    for order in orders:  # (c) and (d) run against one served cluster, next to each other
        assert abs(order.index("c") - order.index("d")) == 1
    firsts = [order[0] for order in orders[:3]]
    assert sorted(firsts) == ["a", "b", "c"] or sorted(firsts) == ["a", "b", "d"]
    assert orders[0] != orders[1] != orders[2]
    assert peers.round_orders(1) == [["a", "b", "c", "d"]]
    assert peers.round_orders(2, ["a", "b"]) == [["a", "b"], ["b", "a"]]


def test_the_summary_is_the_median_with_its_spread_and_ratios_are_medians_of_per_round_ratios():
    samples = {
        "a": [_sample(110), _sample(100), _sample(90)],
        "b": [_sample(100), _sample(50), _sample(80)],  # round 2 ran on a busy machine
        "c": [_sample(98), _sample(49), _sample(78)],
        "d": [_sample(40), _sample(20), _sample(40)],
    }
    summary = peers.summarize(samples, cores=2)
    b = summary["lines"]["b"]["para_per_s"]
    assert (b["median"], b["min"], b["max"], b["n"]) == pytest.approx((80, 50, 100, 3))
    # Per round: 0.98, 0.98, 0.975 -> 0.98; the ratio of the medians (78/80 = 0.975) would mix rounds.
    assert summary["ratios"]["c/b"]["median"] == pytest.approx(0.98)
    assert summary["ratios"]["c/d"]["median"] == pytest.approx(2.45)
    assert summary["ratios"]["c/d"]["min"] == pytest.approx(1.95)
    assert summary["met"] == {"c/b": True, "c/d": True, "cores_busy": True}

    samples["c"] = [_sample(90, busy=1.5), _sample(45, busy=1.5), _sample(72, busy=1.5)]  # 0.9 of (b)
    summary = peers.summarize(samples, cores=2)
    assert summary["met"] == {"c/b": False, "c/d": True, "cores_busy": False}


def test_ratios_pair_the_lines_of_one_round_when_a_line_failed_in_another():
    b = [{"round": 1, **_sample(100)}, {"round": 3, **_sample(50)}]  # failed in round 2
    c = [{"round": 1, **_sample(98)}, {"round": 2, **_sample(10)}, {"round": 3, **_sample(49)}]
    summary = peers.summarize({"b": b, "c": c}, cores=2)
    assert summary["ratios"]["c/b"]["median"] == pytest.approx(0.98)
    assert summary["ratios"]["c/b"]["n"] == 2


def test_a_line_that_failed_in_every_round_has_no_figures_and_no_verdict():
    summary = peers.summarize({"a": [_sample(100)], "b": [_sample(100)], "c": [_sample(99)], "d": []}, cores=2)
    assert "d" not in summary["lines"] and "c/d" not in summary["ratios"]
    assert summary["met"]["c/d"] is None


def _peers_results(samples: dict[str, list[dict[str, object]]]) -> dict[str, object]:
    return {
        "cpu": {"model": "Some Xeon", "flags": ["amx_bf16", "avx512_bf16"], "usable_cpus": 2},
        "models": {
            "minilm-l6": {
                "shape": {"name": "minilm-l6", "layers": 6, "hidden": 384, "max_length": 256},
                "setting": "openvino:fp32",
                "paragraphs": 6000,
                "rounds": 3,
                "summary": peers.summarize(samples, cores=2),
                "errors": {"c,d, round 2": "RuntimeError: bench.peers spark failed (exit 1)"},
            }
        },
    }


def test_the_table_names_cpu_shape_setting_and_shows_each_line_and_the_ratios_against_the_targets():
    samples = {
        "a": [_sample(110), _sample(100)],
        "b": [_sample(100), _sample(90)],
        "c": [_sample(95), _sample(88)],
        "d": [_sample(40)],
    }
    text = "\n".join(peers.peers_tables(_peers_results(samples)))
    assert "Some Xeon (amx_bf16, avx512_bf16), 2 cores" in text
    assert "6×384, max 256 tokens; setting openvino:fp32; 6,000 paragraphs per line, 3 rounds" in text
    assert "| (b) Ray Data map_batches (actor pool, defaults) | 95.0 (90.0–100.0) |" in text
    assert "| (d) PySpark local[2] pandas UDF, 1 paragraph per call, 50 in flight | 40.0 |" in text  # one round
    assert "(c)/(b) **0.964 (0.950–0.978)** (target ≥ 0.97: not met)" in text
    assert "(c)/(d) **2.375** (target ≥ 2: met)" in text
    assert "Failed: (c,d, round 2): RuntimeError" in text


def test_the_performance_page_takes_the_newest_full_run_with_peers_and_names_its_file(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    samples = {k: [_sample(v)] for k, v in {"a": 100, "b": 90, "c": 89, "d": 30}.items()}
    full = {"env": {"git_commit": "abcdef123"}, "peers": _peers_results(samples)}
    quick = {"env": {"git_commit": "fff", "quick": True}, "peers": _peers_results(samples)}
    (results / "bench-20260101T000000Z.json").write_text(json.dumps(full))
    (results / "bench-20260102T000000Z.json").write_text(json.dumps(quick))  # a smoke run: left out
    (results / "bench-20260103T000000Z.json").write_text(json.dumps({"env": {}, "speed": {}}))  # no peers
    bert = _peers_results(samples)
    bert["models"] = {"bert-base": {**bert["models"]["minilm-l6"], "shape": {"layers": 12, "hidden": 768}}}
    later = {"env": {"git_commit": "123456789"}, "peers": bert}  # a later run of another model
    (results / "bench-20260104T000000Z.json").write_text(json.dumps(later))
    block = "\n".join(peers.peers_docs_block(results))
    assert block.count("### Peers: Some Xeon") == 1  # one CPU, one heading; each model names its file
    assert "**bert-base** (12×768" in block and "`bench/results/bench-20260104T000000Z.md` (1234567)" in block
    assert "**minilm-l6** (6×384" in block and "`bench/results/bench-20260101T000000Z.md` (abcdef1)" in block
    assert peers.peers_docs_block(tmp_path) == []

    (tmp_path / "docs").mkdir()
    for name in ("README.md", "docs/performance.md"):
        (tmp_path / name).write_text(f"before\n{docs.BEGIN}\n{docs.END}\nafter\n")
    assert docs.main(["--root", str(tmp_path)]) == 0
    page = (tmp_path / "docs" / "performance.md").read_text()
    assert "### Peers: Some Xeon" in page and "(c)/(d) **2.967**" in page
    assert "Peers" not in (tmp_path / "README.md").read_text()


def test_the_child_refuses_an_unknown_line():
    with pytest.raises(SystemExit, match="unknown peer line"):
        peers.main(["nope", "{}"])


class _CountingServicer(FakeServicer):
    """The fake server, counting the calls in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.most_in_flight = 0

    async def Classify(self, request: Any, context: Any) -> Any:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)  # long enough for the client's calls to overlap
            return await super().Classify(request, context)
        finally:
            self.in_flight -= 1


def test_the_reference_client_sends_one_paragraph_per_call_with_the_token_at_most_n_at_once() -> None:
    servicer = _CountingServicer()
    texts = [f"paragraph {i}" for i in range(40)]

    async def scenario() -> list[str | None]:
        server = grpc.aio.server()
        emotion_pb2_grpc.add_EmotionClassifierServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            metadata = (("application", "raypipe"), ("authorization", "Bearer secret"))
            servicer.fail_next = [grpc.StatusCode.INVALID_ARGUMENT]  # the first call fails: no label, no retry
            labels = await peers._classify_batch(address, metadata, texts, 5)
        finally:
            await server.stop(None)
        return labels

    labels = asyncio.run(scenario())
    assert servicer.forms["rows"] == 39 and servicer.calls["OK"] == 39  # one paragraph per call
    assert 1 < servicer.most_in_flight <= 5
    assert all(seen["authorization"] == "Bearer secret" for seen in servicer.metadata_seen)
    assert labels.count(None) == 1
    expected = [LABELS[int(np.argmax(fake_probs(t)))] for t in texts]
    assert [got == want for got, want in zip(labels, expected, strict=True)].count(False) == 1


def test_the_peers_section_refuses_a_model_it_does_not_know(tmp_path: Path) -> None:
    from bench.peers import peer_models

    with pytest.raises(SystemExit, match="trained-bert-base"):
        peer_models(["gpt-9"], {}, demo=tmp_path, cache=tmp_path, env={}, lock=None)

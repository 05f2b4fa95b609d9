"""`raypipe demo` (`make demo`): the whole path on one machine, on embedded defaults.

Builds (or reuses) the offline demo model while the local Ray cluster and Serve's gRPC proxy start
(the build trains in a child process, so they overlap), writes a sample corpus (Parquet and JSON-lines
shards, with a few bad rows), starts a local Ray cluster and the Serve gRPC app, runs a
backfill through the same code a production job runs, prints the report and a few
predictions, and shuts down what it started. Only the addresses and the model differ from
production.
"""

from __future__ import annotations

import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["run_demo"]


def run_demo(*, workdir: str, rows: int = 3000, model_dir: str | None = None, grpc_port: int = 9000) -> int:
    import pyarrow.compute as pc
    import ray

    from protos.credential import ensure_token, token_digest
    from raypipe import api
    from raypipe.commit.outcomes import latest
    from raypipe.run.driver import start_local_ray, start_ray_data_helpers
    from raypipe.samples import write_sample_corpus
    from serve_app.demo_model import build_demo_model, default_demo_model_dir
    from serve_app.deploy import DeploymentOptions, deploy, fit_replicas, start_grpc_proxy

    t0 = time.monotonic()
    work = Path(workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    # The demo's cluster is its own, also where one already runs on the same machine (`raypipe serve
    # --detach` starts one): "local" starts a new one rather than joining it. Its Serve proxies
    # take free ports where the usual ones are taken (the HTTP proxy is not used).
    if not _port_free(grpc_port):
        taken, grpc_port = grpc_port, _free_port()
        print(f"demo: port {taken} is taken (another Serve app?); the demo's gRPC proxy uses {grpc_port}", flush=True)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="demo-model") as pool:
        building = pool.submit(build_demo_model, model_dir or default_demo_model_dir())
        corpus = write_sample_corpus(str(work / "input"), rows=rows, parquet_shards=4, jsonl_shards=1)
        start_local_ray(address="local", num_cpus=2, include_dashboard=False)
        try:
            # Serve's controller and gRPC proxy start while a first run still trains the model.
            # The cluster lives a minute: its controller keeps Ray's quick control loop, and so
            # starts in a worker Ray already runs rather than one started for it.
            start_grpc_proxy(grpc_port, http_port=_free_port(), controller_env=False)
            model = building.result()
        except BaseException:
            ray.shutdown()
            raise
    print(f"demo: model {model}; {rows:,} paragraphs in 5 shards under {work / 'input'}", flush=True)
    print(f"demo: Ray and the model ready after {time.monotonic() - t0:.1f} s", flush=True)
    try:
        replicas, cpus = fit_replicas(2)  # the defaults `raypipe serve` picks on a 2-CPU cluster
        options = DeploymentOptions(num_replicas=replicas, num_cpus=cpus)
        # The demo's service answers only calls that carry its own token, as `raypipe serve`'s does.
        token_file = work / "service-token"
        token, _ = ensure_token(token_file, environ={})
        # Ray Data's helper actors start here while the replica loads, not on the run's path.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="demo-warm") as pool:
            warm = pool.submit(start_ray_data_helpers)
            address = deploy(model, grpc_port=grpc_port, options=options, token_sha256=token_digest(token))
            warm.result()
        print(f"demo: Serve gRPC app up at {address} after {time.monotonic() - t0:.1f} s", flush=True)
        report = api.backfill(
            str(work / "input"),
            str(work / "output"),
            service=address,
            run_id="demo",
            settings={"service": {"token_file": str(token_file)}},
        )
    finally:
        # The cluster is the demo's own: shutting it down stops Serve too. (serve.shutdown()
        # first would leave the raylet reporting its controller's cancelled graceful shutdown.)
        ray.shutdown()

    print()
    print(report.render())
    table = latest(str(work / "output"))
    table = table.filter(pc.equal(table.column("status"), "ok"))
    print("\nexample predictions:")
    texts = dict(zip(corpus.ids, corpus.texts, strict=True))
    for row in table.slice(0, 5).to_pylist():
        text = (texts.get(row["id"]) or "")[:70]
        print(f"  {row['id']}  {row['top_label']:<9} {row['top_score']:.2f}  {text!r}")
    print(f"\nresults:      {work / 'output' / 'outcomes'}  (Delta Lake table: raypipe.read_outcomes / raypipe.latest)")
    print(f"run report:   {work / 'output' / 'runs' / 'demo.json'}")
    print(f"demo wall time: {time.monotonic() - t0:.1f} s")
    lost = len(corpus.ids) - report.rows_results - report.rows_dead_letters
    return 0 if report.status == "completed" and lost == 0 else 1


def _port_free(port: int) -> bool:
    """Nothing listens on `port`. SO_REUSEADDR as servers bind: the connections of the last demo's
    proxy, closed moments ago (TIME_WAIT), do not make it taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

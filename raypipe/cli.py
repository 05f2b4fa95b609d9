"""The `raypipe` command line (also `python -m raypipe`, e.g. as a `ray job submit` entrypoint).

    raypipe model build-demo DIR
    raypipe serve --model DIR [--grpc-port 9000] [--detach]
    raypipe backfill --input URI --output URI [--service HOST:PORT] [--run-id ID]
    raypipe daily    --input URI --output URI [--service HOST:PORT] [--until ISO]
    raypipe replay   --output URI --run-id ID [--service HOST:PORT]
    raypipe report   --output URI --run-id ID
    raypipe demo

Run commands also take `--config FILE` and `--set section.key=value` (repeatable); the
environment (`RAYPIPE_SECTION__KEY`) sits between the two. Exit codes: 0 the run completed,
1 it failed, 2 bad configuration or input, 3 it finished incomplete (bad shards).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime
from typing import Any

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_INCOMPLETE = 0, 1, 2, 3


def _set_pairs(pairs: list[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set takes section.key=value, not {pair!r}")
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _add_run_args(p: argparse.ArgumentParser, *, with_input: bool) -> None:
    if with_input:
        p.add_argument("--input", help="shards to read: a file, folder or glob, local or s3://")
    p.add_argument("--output", help="output location, local or s3://")
    p.add_argument("--service", help="host:port of the Serve gRPC proxy (default 127.0.0.1:9000)")
    p.add_argument("--config", help="a YAML or JSON config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model directories").add_subparsers(dest="model_command", required=True)
    demo_model = model.add_parser("build-demo", help="build the offline demo model (cached)")
    demo_model.add_argument("dir")
    demo_model.add_argument("--force", action="store_true", help="rebuild even if cached")

    serve = sub.add_parser("serve", help="deploy the EmotionClassifier Serve app")
    serve.add_argument("--model", required=True, help="model directory")
    serve.add_argument("--grpc-port", type=int, default=9000)
    serve.add_argument("--http-port", type=int, default=None, help="Serve's HTTP port (default 8000)")
    serve.add_argument("--app-name", default="raypipe")
    serve.add_argument("--num-replicas", type=int, default=1)
    serve.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
    serve.add_argument("--max-ongoing-requests", type=int, default=16)
    serve.add_argument("--settings", help="YAML file of server settings (serve_app.settings.ServerSettings)")
    serve.add_argument("--detach", action="store_true", help="deploy and return (needs a running cluster)")

    backfill = sub.add_parser("backfill", help="classify every paragraph of the input")
    _add_run_args(backfill, with_input=True)
    backfill.add_argument("--run-id", help="names the run; the same id resumes it")

    daily = sub.add_parser("daily", help="classify paragraphs new or changed since the last daily run")
    _add_run_args(daily, with_input=True)
    daily.add_argument("--run-id")
    daily.add_argument("--until", help="ISO time with zone: upper bound of updated_at (default: now)")

    replay = sub.add_parser("replay", help="re-infer a run's dead letters into its results")
    _add_run_args(replay, with_input=False)
    replay.add_argument("--run-id", required=True, help="the run whose dead letters to replay")

    report = sub.add_parser("report", help="print a run's report")
    report.add_argument("--output", required=True)
    report.add_argument("--run-id", required=True)
    report.add_argument("--json", action="store_true")

    demo = sub.add_parser("demo", help="the whole path on a local cluster with the demo model")
    demo.add_argument("--workdir", default="demo-output")
    demo.add_argument("--rows", type=int, default=3000)
    demo.add_argument("--model-dir", help="default: .cache/demo-model")
    demo.add_argument("--grpc-port", type=int, default=9000)
    return parser


def _run(args: argparse.Namespace) -> int:
    from raypipe import api, modes
    from raypipe.report import RunReport

    config = api.build_config(
        input=getattr(args, "input", None),
        output=args.output,
        service=args.service,
        run_id=None if args.command == "replay" else args.run_id,
        config_file=args.config,
        settings=_set_pairs(args.set),
    )
    report: RunReport
    if args.command == "backfill":
        report = modes.backfill(config)
    elif args.command == "daily":
        until = None if args.until is None else datetime.fromisoformat(args.until)
        report = modes.daily(config, until=until)
    else:
        report = modes.replay(config, of_run=args.run_id)
    print(report.render())
    print(f"  report        {config.output.uri.rstrip('/')}/runs/{report.run_id}.json")
    return EXIT_OK if report.status == "completed" else EXIT_INCOMPLETE


def _serve(args: argparse.Namespace) -> int:
    import time

    import ray
    import yaml
    from ray import serve

    from serve_app.deploy import DeploymentOptions, deploy
    from serve_app.settings import ServerSettings

    settings = ServerSettings()
    if args.settings:
        with open(args.settings) as f:
            settings = ServerSettings.from_dict(yaml.safe_load(f))
    if args.detach:
        ray.init(address="auto", logging_level=logging.WARNING)
    else:
        ray.init(logging_level=logging.WARNING)
    address = deploy(
        args.model,
        app_name=args.app_name,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        settings=settings,
        options=DeploymentOptions(
            num_replicas=args.num_replicas, num_cpus=args.num_cpus, max_ongoing_requests=args.max_ongoing_requests
        ),
    )
    print(f"EmotionClassifier serving on {address} (application {args.app_name!r})", flush=True)
    if args.detach:
        return EXIT_OK
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from raypipe.report import RunReport
    from raypipe.store import OutputStore

    store = OutputStore(args.output)
    data = store.read_json_or_none(store.report_file(args.run_id))
    if data is None:
        print(f"no report for run {args.run_id} at {args.output}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        data.pop("rows_results", None)
        print(RunReport(**data).render())
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from raypipe.errors import ConfigError, InputError, RaypipeError

    try:
        if args.command == "model":
            from serve_app.demo_model import build_demo_model

            print(build_demo_model(args.dir, force=args.force))
            return EXIT_OK
        if args.command == "serve":
            return _serve(args)
        if args.command == "report":
            return _report(args)
        if args.command == "demo":
            from raypipe.demo import run_demo

            return run_demo(workdir=args.workdir, rows=args.rows, model_dir=args.model_dir, grpc_port=args.grpc_port)
        return _run(args)
    except (ConfigError, InputError) as e:
        print(f"raypipe: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except RaypipeError as e:
        print(f"raypipe: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED

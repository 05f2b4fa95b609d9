"""The `raypipe` command line (also `python -m raypipe`, e.g. as a `ray job submit` entrypoint).

    raypipe model build-demo DIR
    raypipe model export (--from-hf DIR | --from-savedmodel DIR --labels A,B --tokenizer DIR) OUT
    raypipe model check DIR
    raypipe model optimize DIR [--sample URI] [--threshold 0.99] [--no-int8]
    raypipe serve --model DIR [--grpc-port 9000] [--host 127.0.0.1] [--token-file F] [--detach] [--wait-s 300]
    raypipe backfill --input URI --output URI [--service HOST:PORT] [--run-id ID]
    raypipe daily    --input URI --output URI [--service HOST:PORT] [--since ISO]
    raypipe replay   --output URI --run-id ID [--replay-id ID] [--service HOST:PORT]
    raypipe watch    --input URI --output URI [--every 60s] [--max-wait 60s] [--events-queue URL]
    raypipe report   --output URI --run-id ID [--json]
    raypipe compact  --output URI [--run-id ID]          (small files of finished runs)
    raypipe vacuum   --output URI [--retention-hours H] [--dry-run]  (Delta vacuum, old runs' state)
    raypipe migrate  --output URI                        (the earlier layout -> the table)
    raypipe shards quarantine|release --output URI SHARD...
    raypipe lease show|expire --output URI [--run-id ID]
    raypipe demo

Run commands also take `--config FILE` and `--set section.key=value` (repeatable); the
environment (`RAYPIPE_SECTION__KEY`) sits between the two. Exit codes: 0 the run completed,
1 it failed, 2 bad configuration or input, 3 it finished incomplete (bad shards), 143 SIGTERM
stopped it (its report says failed; the same run id resumes it).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, NoReturn

from raypipe.run.watch import command as watch_command

__all__ = ["main", "run"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_INCOMPLETE, EXIT_STOPPED = 0, 1, 2, 3, 143


_EXIT_CODES = """\
exit codes:
  0    done
  1    failed (stderr says why)
  2    bad configuration, input or argument: one line on stderr names it"""

_RUN_EXIT_CODES = """\
exit codes:
  0    the run completed
  1    it failed (e.g. the model service down past client.breaker.max_wait_s); the same
       --run-id resumes it
  2    bad configuration, input or argument: one line on stderr names it
  3    it finished incomplete: bad shards, listed in its report
  143  SIGTERM stopped it: its report says failed; the same --run-id resumes it"""

_SETTINGS = """\
settings, later layers winning: --config FILE (YAML or JSON), then the environment
(RAYPIPE_<SECTION>__<FIELD>, e.g. RAYPIPE_SERVICE__ADDRESS=10.0.0.5:9000; top-level
settings such as core_hour_usd have none), then the flags and --set section.key=value
(repeatable, e.g. --set input.unit_rows=5000 --set client.retry.max_attempts=6).
docs/configuration.md lists every setting."""

_RUN_COMMANDS = ("raypipe", "raypipe backfill", "raypipe daily", "raypipe replay")
"""The parsers whose help shows how settings are layered and a run's exit codes."""

_EXAMPLES = {
    "raypipe": [
        "raypipe model build-demo .cache/demo-model",
        "raypipe serve --model .cache/demo-model --detach",
        "raypipe backfill --input 's3://bucket/shards/*.parquet' --output s3://bucket/out --run-id backfill-1",
        "raypipe report --output s3://bucket/out --run-id backfill-1",
    ],
    "raypipe model": ["raypipe model build-demo .cache/demo-model", "raypipe model check ./my-model"],
    "raypipe model build-demo": ["raypipe model build-demo .cache/demo-model"],
    "raypipe model export": [
        "raypipe model export --from-hf ./checkpoint ./my-model",
        "raypipe model export --from-savedmodel ./saved --labels joy,anger,fear --tokenizer ./tok ./my-model",
    ],
    "raypipe model check": ["raypipe model check ./my-model", "raypipe model check ./my-model --text 'What a day!'"],
    "raypipe model optimize": [
        "raypipe model optimize ./my-model --sample 's3://bucket/shards/part-0*.parquet'",
        "raypipe model optimize ./my-model --no-int8",
    ],
    "raypipe serve": [
        "raypipe serve --model .cache/demo-model --detach",
        "raypipe serve --model ./my-model --num-replicas auto --max-replicas 4 --precision auto",
    ],
    "raypipe backfill": [
        "raypipe backfill --input 's3://bucket/shards/*.parquet' --output s3://bucket/out --run-id backfill-1",
        "raypipe backfill --input ./shards --output ./out --service 127.0.0.1:9000 --set input.unit_rows=5000",
        "raypipe backfill --config job.yaml --run-id backfill-1 --force",
    ],
    "raypipe daily": [
        "raypipe daily --input 's3://bucket/shards/*.parquet' --output s3://bucket/out",
        "raypipe daily --input ./shards --output ./out --since 2026-11-20T00:00:00+00:00",
        "raypipe daily --config job.yaml --set input.on_bad_shard=fail",
    ],
    "raypipe watch": watch_command.EXAMPLES,
    "raypipe replay": [
        "raypipe replay --output s3://bucket/out --run-id backfill-1",
        "raypipe replay --output ./out --run-id backfill-1 --replay-id backfill-1.replay-1",
    ],
    "raypipe compact": [
        "raypipe compact --output s3://bucket/out",
        "raypipe compact --output ./out --run-id backfill-1",
    ],
    "raypipe vacuum": ["raypipe vacuum --output s3://bucket/out --dry-run", "raypipe vacuum --output ./out"],
    "raypipe shards": ["raypipe shards quarantine --output s3://bucket/out s3://bucket/shards/part-7.parquet"],
    "raypipe shards quarantine": [
        "raypipe shards quarantine --output s3://bucket/out s3://bucket/shards/part-7.parquet --reason 'truncated'"
    ],
    "raypipe shards release": ["raypipe shards release --output s3://bucket/out s3://bucket/shards/part-7.parquet"],
    "raypipe lease": ["raypipe lease show --output s3://bucket/out"],
    "raypipe lease show": ["raypipe lease show --output s3://bucket/out"],
    "raypipe lease expire": ["raypipe lease expire --output s3://bucket/out --run-id backfill-1"],
    "raypipe migrate": ["raypipe migrate --output s3://bucket/out"],
    "raypipe report": [
        "raypipe report --output s3://bucket/out --run-id backfill-1",
        "raypipe report --output ./out --run-id backfill-1 --json",
    ],
    "raypipe demo": ["raypipe demo", "raypipe demo --rows 10000 --workdir /tmp/raypipe-demo"],
}
"""Each parser's examples, by its `prog`."""


def _add_help_tails(parser: argparse.ArgumentParser) -> None:
    """Gives `parser` and every parser under it a `--help` tail: examples, how settings are
    layered (run commands) and the exit codes, kept as written (`RawDescriptionHelpFormatter`)."""
    examples = "examples:\n" + "\n".join(f"  {e}" for e in _EXAMPLES[parser.prog])
    tail = [_SETTINGS, _RUN_EXIT_CODES] if parser.prog in _RUN_COMMANDS else [_EXIT_CODES]
    parser.epilog = "\n\n".join([examples, *tail])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                _add_help_tails(child)


def _set_pairs(pairs: list[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            from raypipe.errors import ConfigError

            raise ConfigError(f"--set takes section.key=value, not {pair!r}")
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
    p.add_argument(
        "--service",
        help="the model service (Serve's gRPC proxy): host:port, grpc://host:port or grpcs://host:port "
        "(default: service.address, 127.0.0.1:9000)",
    )
    p.add_argument("--config", metavar="FILE", help="a YAML or JSON config file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting, e.g. input.unit_rows=5000 (repeatable)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="take over the live lease of an earlier attempt of the same run at once (it is fenced off) "
        "instead of waiting for it to expire",
    )


def _replicas(value: str) -> int | str:
    if value == "auto":
        return value
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError("needs at least 1 replica (or auto)")
    return count


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError("must be a number of seconds > 0")
    return seconds


def _parser() -> argparse.ArgumentParser:
    from serve_app.settings import PRECISION_SETTINGS, RUNTIME_SETTINGS

    parser = argparse.ArgumentParser(
        prog="raypipe", description=__doc__.split("\n\n")[0] + "\n\nEach command's flags: raypipe COMMAND --help."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model directories").add_subparsers(dest="model_command", required=True)
    demo_model = model.add_parser("build-demo", help="build the offline demo model (cached)")
    demo_model.add_argument("dir")
    demo_model.add_argument("--force", action="store_true", help="rebuild even if cached")
    export = model.add_parser("export", help="export a fine-tuned checkpoint to a served model directory")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="a local Hugging Face checkpoint (TF or PyTorch safetensors)")
    source.add_argument("--from-savedmodel", metavar="DIR", help="a TF SavedModel (needs --labels and --tokenizer)")
    export.add_argument("out", help="the model directory to write")
    export.add_argument("--labels", help="label names in output order, comma-separated (default: id2label)")
    export.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the checkpoint's)")
    export.add_argument("--max-length", type=int, help="most tokens per text (default: the model's limit)")
    export.add_argument("--name", help="version prefix (default: model type and size, e.g. bert-6x384)")
    export.add_argument("--signature", default="serving_default", help="SavedModel signature to serve")
    export.add_argument("--output", help="SavedModel signature output to serve (default: probabilities or logits)")
    export.add_argument("--output-kind", choices=("auto", "logits", "probabilities"), default="auto")
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    optimize = model.add_parser(
        "optimize",
        help="compile DIR for OpenVINO (DIR/openvino/), build int8, and measure every runtime x precision "
        "against TensorFlow fp32 on a sample of your text (DIR/runtimes.json, read by precision: auto)",
    )
    optimize.add_argument("dir")
    optimize.add_argument(
        "--sample",
        metavar="URI",
        help="Parquet or JSON-lines file or glob, local or s3:// "
        "(default: the check texts and generated demo paragraphs)",
    )
    optimize.add_argument("--text-column", default="text")
    optimize.add_argument(
        "--rows", type=int, default=1200, help="most sample texts to read (30%% calibrate, the rest held out)"
    )
    optimize.add_argument(
        "--threshold", type=float, default=0.99, help="agreement the int8 build aims for (default 0.99)"
    )
    optimize.add_argument("--threads", type=int, default=0, help="threads per forward pass (default: the CPUs)")
    optimize.add_argument("--no-int8", action="store_true", help="skip the int8 build (NNCF)")
    optimize.add_argument(
        "--int8-max-reverts",
        type=int,
        default=6,
        help="most NNCF accuracy-control iterations, each reverting ops to fp32 (~2 min each for MiniLM on 2 cores)",
    )
    check = model.add_parser("check", help="load a model directory as the server does; show its card and predictions")
    check.add_argument("dir")
    check.add_argument("--text", action="append", help="a text to classify (repeatable; default: a few samples)")
    check.add_argument("--threshold", type=float, default=0.99, help="the agreement gate the runtime table marks")

    serve = sub.add_parser("serve", help="deploy the EmotionClassifier Serve app")
    serve.add_argument("--model", required=True, help="model directory")
    serve.add_argument("--grpc-port", type=int, default=9000)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the gRPC proxy binds (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)",
    )
    serve.add_argument(
        "--token-file",
        default=None,
        help="the service's bearer token, created (mode 600) when absent; calls without it get UNAUTHENTICATED "
        "(default ~/.raypipe/service-token; RAYPIPE_SERVICE_TOKEN wins where set)",
    )
    serve.add_argument("--http-port", type=int, default=None, help="Serve's HTTP port (default 8000)")
    serve.add_argument("--app-name", default="raypipe")
    serve.add_argument(
        "--num-replicas",
        type=_replicas,
        default=None,
        help="a count, or auto (Serve autoscaling up to --max-replicas); default: 1 replica, or one per pool "
        "node when nodes advertise the pool resource (raypipe_pool)",
    )
    serve.add_argument(
        "--num-cpus",
        type=float,
        default=None,
        help="CPUs per replica (default: a node's CPUs less 0.5; on a pool, its smallest node's)",
    )
    scaling = serve.add_argument_group("autoscaling (with --num-replicas auto)")
    scaling.add_argument("--min-replicas", type=int, default=1)
    scaling.add_argument("--max-replicas", type=int, default=None, help="default: the replicas the CPUs hold")
    scaling.add_argument("--target-ongoing-requests", type=float, default=4.0, help="calls per replica Serve aims at")
    scaling.add_argument("--upscale-delay-s", type=float, default=30.0)
    scaling.add_argument("--downscale-delay-s", type=float, default=300.0)
    scaling.add_argument("--look-back-period-s", type=float, default=30.0, help="window of the load average")
    serve.add_argument("--max-ongoing-requests", type=int, default=64, help="calls one replica holds at once")
    serve.add_argument(
        "--max-queued-requests", type=int, default=256, help="calls queued at the proxy before RESOURCE_EXHAUSTED"
    )
    serve.add_argument("--settings", help="YAML file of server settings (serve_app.settings.ServerSettings)")
    serve.add_argument(
        "--precision",
        choices=PRECISION_SETTINGS,
        help="compute precision (overrides --settings); bf16 needs AVX512_BF16 or AMX; int8 runs on OpenVINO; "
        "auto serves the fastest setting `raypipe model optimize` measured at >= min_agreement (else fp32)",
    )
    serve.add_argument(
        "--runtime",
        choices=RUNTIME_SETTINGS,
        help="tensorflow (the reference), openvino, or auto (overrides --settings)",
    )
    serve.add_argument(
        "--force-precision",
        action="store_true",
        help="serve --precision even if its recorded agreement is under min_agreement",
    )
    serve.add_argument(
        "--detach",
        action="store_true",
        help="deploy and return: on the cluster at RAY_ADDRESS or running here, else on a local one it starts",
    )
    serve.add_argument(
        "--wait-s",
        type=_positive_seconds,
        default=None,
        help="most seconds to wait for every replica to be RUNNING; past it, exit 1 naming the replicas not "
        "RUNNING, their nodes and what they wait for (default 300; raise it where the cluster adds nodes)",
    )

    backfill = sub.add_parser("backfill", help="classify every paragraph of the input")
    _add_run_args(backfill, with_input=True)
    backfill.add_argument("--run-id", help="names the run; the same id resumes it")

    daily = sub.add_parser("daily", help="classify paragraphs new or changed since the last daily run")
    _add_run_args(daily, with_input=True)
    daily.add_argument("--run-id")
    daily.add_argument(
        "--since",
        help="ISO time with zone: also re-read the unchanged files read before, for their rows updated at or after "
        "it (a rerun over an earlier window; default: only new and changed files, each read whole)",
    )

    replay = sub.add_parser("replay", help="re-infer a run's dead letters into its results")
    _add_run_args(replay, with_input=False)
    replay.add_argument("--run-id", required=True, help="the run whose dead letters to replay")
    replay.add_argument(
        "--replay-id",
        help="names the replay (default: resume the latest unfinished <run-id>.replay-<n>, else a new one)",
    )

    watch_command.add_parser(sub, _add_run_args)

    compact = sub.add_parser("compact", help="merge finished runs' small files (dead letters stay apart)")
    compact.add_argument("--output", required=True)
    compact.add_argument("--run-id", action="append", help="only these runs (repeatable; default: every finished run)")
    vacuum = sub.add_parser(
        "vacuum",
        help="Delta vacuum: delete files no commit references (fenced-off attempts, compacted files) and old run state",
    )
    vacuum.add_argument("--output", required=True)
    vacuum.add_argument("--retention-hours", type=float, default=168.0)
    vacuum.add_argument("--dry-run", action="store_true")
    vacuum.add_argument(
        "--force", action="store_true", help="allow a retention under 168 h (only when no run writes to the output)"
    )
    shards = sub.add_parser("shards", help="set input shards aside").add_subparsers(
        dest="shards_command", required=True
    )
    for name, what in (("quarantine", "skip these shards in every later run (listed in each report)"),
                       ("release", "read these shards again")):  # fmt: skip
        q = shards.add_parser(name, help=what)
        q.add_argument("--output", required=True)
        q.add_argument("shard", nargs="+", help="shard URIs, as the report's bad_shards list them")
        if name == "quarantine":
            q.add_argument("--reason", default="set aside by an operator")
    lease = sub.add_parser("lease", help="the output's lease: who holds it; declare a dead attempt dead")
    lease_sub = lease.add_subparsers(dest="lease_command", required=True)
    for name, text in (("show", "print the lease record"), ("expire", "expire the lease now (its holder is dead)")):
        q = lease_sub.add_parser(name, help=text)
        q.add_argument("--output", required=True)
        if name == "expire":
            q.add_argument("--run-id", help="only if this run holds it")

    migrate = sub.add_parser(
        "migrate", help="copy an output of the earlier layout (results/, dead_letters/ Parquet) into the outcomes table"
    )
    migrate.add_argument("--output", required=True)

    report = sub.add_parser("report", help="print a run's report")
    report.add_argument("--output", required=True)
    report.add_argument("--run-id", required=True)
    report.add_argument("--json", action="store_true")

    demo = sub.add_parser("demo", help="the whole path on a local cluster with the demo model")
    demo.add_argument("--workdir", default="demo-output")
    demo.add_argument("--rows", type=int, default=3000)
    demo.add_argument("--model-dir", help="default: .cache/demo-model")
    demo.add_argument("--grpc-port", type=int, default=9000)
    _add_help_tails(parser)
    return parser


def _run(args: argparse.Namespace) -> int:
    from raypipe import api
    from raypipe.report import RunReport

    common: dict[str, Any] = {
        "service": args.service,
        "config_file": args.config,
        "settings": _set_pairs(args.set + (["output.take_over_lease=true"] if args.force else [])),
    }
    report: RunReport
    if args.command == "backfill":
        report = api.backfill(args.input, args.output, run_id=args.run_id, **common)
    elif args.command == "daily":
        report = api.daily(args.input, args.output, run_id=args.run_id, since=args.since, **common)
    else:
        report = api.replay(args.output, run_id=args.run_id, replay_id=args.replay_id, **common)
    print(report.render())
    print(f"  report        {(report.output or args.output or '').rstrip('/')}/runs/{report.run_id}.json")
    return EXIT_OK if report.status == "completed" else EXIT_INCOMPLETE


def _model(args: argparse.Namespace) -> int:
    from serve_app.model import ModelDirError

    try:
        if args.model_command == "build-demo":
            from serve_app.demo_model import build_demo_model

            print(build_demo_model(args.dir, force=args.force))
        elif args.model_command == "export":
            print(_export(args))
        elif args.model_command == "optimize":
            _optimize(args)
        else:
            from serve_app.export import check_model_dir
            from serve_app.optimize import render_table
            from serve_app.runtimes import read_records

            print(check_model_dir(args.dir, texts=args.text).render())
            for record in read_records(args.dir):  # one per CPU class that measured
                print()
                print(render_table(record, threshold=args.threshold))
    # ModelDirError (and ExportError, a subclass) names the file at fault; ValueError is a bad
    # argument (a version name, a label list).
    except (ModelDirError, ValueError) as e:
        print(f"raypipe: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return EXIT_OK


def _optimize(args: argparse.Namespace) -> None:
    import os

    from serve_app.optimize import default_sample, optimize, read_sample, render_table, split_sample

    if args.sample:
        texts, source = read_sample(args.sample, text_column=args.text_column, rows=args.rows), args.sample
    else:
        texts, source = default_sample(args.rows), "default sample (check texts, generated demo paragraphs)"
    sample = split_sample(texts, source=source)
    result = optimize(
        args.dir,
        sample,
        threshold=args.threshold,
        threads=args.threads or os.cpu_count() or 1,
        int8=not args.no_int8,
        int8_max_reverts=args.int8_max_reverts,
    )
    if "error" in result.int8:
        print(f"int8: not built, NNCF could not hold the agreement: {result.int8['error']}")
    print(render_table(result.record, threshold=args.threshold))
    print(f"written: {result.record_path}")


def _export(args: argparse.Namespace) -> Any:
    from serve_app.export import export_hf_checkpoint, export_saved_model

    labels = None if args.labels is None else [x.strip() for x in args.labels.split(",")]
    common: dict[str, Any] = {"max_sequence_length": args.max_length, "name": args.name, "overwrite": args.force}
    if args.from_hf is not None:
        if args.signature != "serving_default" or args.output is not None or args.output_kind != "auto":
            raise ValueError("--signature, --output and --output-kind apply to --from-savedmodel only")
        return export_hf_checkpoint(args.from_hf, args.out, labels=labels, tokenizer_dir=args.tokenizer, **common)
    if labels is None or args.tokenizer is None:
        raise ValueError("--from-savedmodel needs --labels and --tokenizer")
    return export_saved_model(
        args.from_savedmodel,
        args.out,
        labels=labels,
        tokenizer_dir=args.tokenizer,
        signature=args.signature,
        output=args.output,
        output_kind=args.output_kind,
        **common,
    )


def _serve(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    import ray
    import yaml
    from ray import serve

    from serve_app.deploy import (
        DEFAULT_WAIT_S,
        POOL_RESOURCE,
        AppNotRunningError,
        Autoscaling,
        ControllerUnreachableError,
        DeploymentOptions,
        deploy,
        pool_nodes,
        size_replicas,
    )
    from serve_app.model import ModelDirError, read_model_card
    from serve_app.settings import ServerSettings

    # Checked before Ray starts: a wrong path or settings file is one line, not a cluster's log.
    settings = ServerSettings()
    try:
        read_model_card(args.model)
        if args.settings:
            with open(args.settings) as f:
                settings = ServerSettings.from_dict(yaml.safe_load(f))
    except (ModelDirError, OSError, ValueError, yaml.YAMLError) as e:
        print(f"raypipe: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    from protos.credential import CredentialError, default_token_file, ensure_token, token_digest

    try:
        token, created = ensure_token(args.token_file)
    except (CredentialError, OSError) as e:
        print(f"raypipe: --token-file: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if created:
        print(f"raypipe: wrote the service's token to {args.token_file or default_token_file()} (mode 600)", flush=True)
    if args.precision:
        settings = dataclasses.replace(settings, precision=args.precision)
    if args.runtime:
        settings = dataclasses.replace(settings, runtime=args.runtime)
    if args.force_precision:
        settings = dataclasses.replace(settings, force_precision=True)
    import os
    import threading

    from raypipe.run.driver import start_local_cluster, start_local_ray
    from raypipe.run.preflight import check_ray_address

    check_ray_address(os.environ)  # a RAY_ADDRESS nobody answers at: ray.init would retry for minutes
    if args.detach:
        try:
            start_local_ray(address="auto")
        except ConnectionError:
            # No cluster to join (RAY_ADDRESS unset, none running here): start a lean local one.
            try:
                start_local_cluster()
            except RuntimeError as e:
                print(f"raypipe: serve --detach found no Ray cluster and could not start one: {e}", file=sys.stderr)
                return EXIT_FAILED
            print("raypipe: started a local Ray cluster for the service (`ray stop` stops it)", flush=True)
            start_local_ray(address="auto")
    else:
        # In the foreground the replicas' own lines are the server's log: show them.
        start_local_ray(log_to_driver=True)
    # Nodes that advertise the pool resource take the replicas (the head and the jobs' nodes
    # do not); without any, the replicas go wherever the cluster has CPUs (one machine).
    pool = pool_nodes(ray.nodes())
    default_replicas, cpus, capacity = size_replicas(pool, ray.cluster_resources().get("CPU", 1.0), args.num_cpus)
    replicas = default_replicas if args.num_replicas is None else args.num_replicas
    autoscaling = None
    if replicas == "auto":
        autoscaling = Autoscaling(
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas or max(capacity, args.min_replicas),
            target_ongoing_requests=args.target_ongoing_requests,
            upscale_delay_s=args.upscale_delay_s,
            downscale_delay_s=args.downscale_delay_s,
            look_back_period_s=args.look_back_period_s,
        )
        replicas = args.min_replicas
    # Ray Data's cluster-wide helpers start while the replicas load, so the first run after
    # `raypipe serve` does not start them on its path; a failure there costs that run time only.
    warm = threading.Thread(target=_start_ray_data_helpers, name="serve-warm", daemon=True)
    warm.start()
    try:
        address = deploy(
            args.model,
            app_name=args.app_name,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            settings=settings,
            options=DeploymentOptions(
                num_replicas=int(replicas),
                autoscaling=autoscaling,
                resources=((POOL_RESOURCE, 1.0),) if pool else (),
                num_cpus=cpus,
                max_ongoing_requests=args.max_ongoing_requests,
                max_queued_requests=args.max_queued_requests,
            ),
            wait_s=args.wait_s or DEFAULT_WAIT_S,
            host=args.host,
            token_sha256=token_digest(token),
        )
    except AppNotRunningError as e:
        print(f"raypipe: {e} (it stays deployed; `serve status` follows it, --wait-s waits longer)", file=sys.stderr)
        return EXIT_FAILED
    except ControllerUnreachableError as e:
        print(f"raypipe: {e}", file=sys.stderr)
        return EXIT_FAILED
    warm.join(timeout=WARM_WAIT_S)
    shape = (
        f"{autoscaling.min_replicas}-{autoscaling.max_replicas} replicas (auto)"
        if autoscaling
        else f"{replicas} replica{'s' if replicas != 1 else ''}"
    )
    where = f" on {len(pool)} pool node{'s' if len(pool) != 1 else ''}" if pool else ""
    print(
        f"EmotionClassifier serving on {address} (application {args.app_name!r}): {shape} of {cpus:g} CPUs{where}",
        flush=True,
    )
    if args.detach:
        return EXIT_OK
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return EXIT_OK


#: How long `raypipe serve` waits, once its replicas run, for Ray Data's helpers to finish starting.
WARM_WAIT_S = 30.0


def _start_ray_data_helpers() -> None:
    """`start_ray_data_helpers` in serve's background thread: an optimization of the next run's
    start (which starts them itself where this did not), so a failure is a debug line only."""
    from raypipe.run.driver import start_ray_data_helpers

    try:
        start_ray_data_helpers()
    except Exception as e:
        logging.getLogger("raypipe").debug("Ray Data's helpers did not start ahead of the first run: %s", e)


def _lease(args: argparse.Namespace) -> int:
    from raypipe.commit.lease import Lease
    from raypipe.store import OutputStore

    lease = Lease(OutputStore(args.output), "raypipe-cli")
    if args.lease_command == "show":
        current = lease.current()
        print(json.dumps({k: v for k, v in (current or {}).items() if k != "token"} or None, indent=1))
        return EXIT_OK
    expired = lease.expire(run_id=args.run_id)
    if expired is None:
        print(f"{args.output}: no lease (no run is writing)")
    else:
        print(
            f"expired the lease of run {expired.get('holder')} (generation {expired.get('generation')}, host "
            f"{expired.get('host')}, pid {expired.get('pid')}); a waiting attempt takes over now, and the old one, "
            "if alive, stops at its next renewal"
        )
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from raypipe.api import report_dict
    from raypipe.report import RunReport

    data = report_dict(args.output, args.run_id)  # RunNotFoundError (a ConfigError): exit 2, naming the nearest
    print(json.dumps(data, indent=1) if args.json else RunReport.from_dict(data).render())
    return EXIT_OK


def _check_upkeep(args: argparse.Namespace) -> None:
    """`ConfigError` where compact or migrate has nothing to work on: an output without the
    outcomes table (compact), or without runs of the earlier layout (migrate)."""
    from raypipe.commit.table import OutcomeTable
    from raypipe.commit.upkeep import LegacyLayout
    from raypipe.config import check_run_id
    from raypipe.errors import ConfigError
    from raypipe.store import OutputStore

    for run_id in getattr(args, "run_id", None) or []:
        check_run_id(run_id, what="--run-id")
    if args.command == "compact" and not OutcomeTable(args.output).exists():
        raise ConfigError(f"output {args.output} holds no outcomes table: nothing to compact (check --output)")
    if args.command == "migrate" and not LegacyLayout(OutputStore(args.output)).runs():
        raise ConfigError(
            f"output {args.output} holds no runs of the earlier layout (_raypipe/runs/): nothing to migrate "
            "(check --output)"
        )


def run() -> NoReturn:
    """The console entry point (``raypipe``, ``python -m raypipe``): `main`, then a quick exit.

    When `main` returns, what raypipe started is stopped and its output written; what is left is
    the interpreter tearing down the ~1,800 modules of Ray, Ray Data, Serve and the rest, half a
    second of every command's wall (importing those three and exiting takes 1.54 s, 1.05 s
    without the teardown), which a short daily or the demo waits for. So the exit does what
    Python's own does first, in its order (join the non-daemon threads, run the atexit handlers:
    Ray's disconnect, done just before by `_disconnect_ray`, and logging's flush), flushes the
    standard streams and ends the process there.
    Both calls are CPython's own finalization steps (private names, stable since 3.x); an
    exception out of `main` takes the ordinary exit.
    """
    import atexit
    import os
    import threading

    code = main()
    threading._shutdown()  # type: ignore[attr-defined]
    _disconnect_ray()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _disconnect_ray() -> None:
    """Disconnect from Ray before the atexit handlers run, where Ray's own first sleeps half a
    second "to make sure log messages finish printing" (`ray.shutdown(_exiting_interpreter=True)`):
    raypipe's runs do not forward the workers' logs (``log_to_driver=False``), so there is none to
    wait for, and every command would end half a second later than its work. The disconnect
    itself is the same; Ray's handler then finds nothing left to do."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from raypipe.redact import install

    install()  # no credential in any line, at any level (botocore's DEBUG headers included)
    if not args.verbose:
        # "Found credentials in environment variables" on every S3 run: not news to the user.
        for name in ("botocore", "aiobotocore", "s3fs"):
            logging.getLogger(name).setLevel(logging.WARNING)
    from protos.quiet import filtered_stderr

    # Known native lines a healthy run prints on a CPU machine (protos.quiet.NOISE), nothing else.
    with filtered_stderr():
        return _dispatch(args)


def _dispatch(args: argparse.Namespace) -> int:
    from raypipe.errors import ConfigError, InputError, RaypipeError, RunStopped
    from raypipe.redact import redact

    try:
        if args.command == "model":
            return _model(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "report":
            return _report(args)
        if args.command == "shards":
            from raypipe.commit.upkeep import quarantine
            from raypipe.store import OutputStore

            store = OutputStore(args.output)
            if not store.fs.exists(store.path()):  # a mistyped output must not be created by it
                raise ConfigError(
                    f"output {args.output} does not exist: give the output of the runs that read the shards"
                )
            release = args.shards_command == "release"
            held = quarantine(args.output, args.shard, reason=getattr(args, "reason", ""), release=release)
            print(json.dumps({"quarantined": held}))
            return EXIT_OK
        if args.command == "lease":
            return _lease(args)
        if args.command in ("compact", "vacuum", "migrate"):
            from raypipe.commit import upkeep

            _check_upkeep(args)
            if args.command == "compact":
                try:
                    done = upkeep.compact(args.output, run_ids=args.run_id)
                except ValueError as e:  # runs named that have not finished
                    raise ConfigError(f"compact: {e}; compact them once they finish") from None
            elif args.command == "vacuum":
                done = upkeep.vacuum(
                    args.output, retention_hours=args.retention_hours, dry_run=args.dry_run, force=args.force
                )
            else:
                done = upkeep.migrate(args.output)
            print(json.dumps(done))
            return EXIT_OK
        if args.command == "watch":
            return watch_command.run(
                args, _set_pairs(args.set + (["output.take_over_lease=true"] if args.force else []))
            )
        if args.command == "demo":
            from raypipe.demo import run_demo

            return run_demo(workdir=args.workdir, rows=args.rows, model_dir=args.model_dir, grpc_port=args.grpc_port)
        return _run(args)
    except (ConfigError, InputError) as e:
        print(f"raypipe: {redact(str(e))}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except RaypipeError as e:
        print(f"raypipe: {type(e).__name__}: {redact(str(e))}", file=sys.stderr)
        return EXIT_FAILED
    except RunStopped as e:
        print(f"raypipe: {e}; the run's report says failed, and the same --run-id resumes it", file=sys.stderr)
        return EXIT_STOPPED

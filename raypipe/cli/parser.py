"""The `raypipe` command line's words: its parser, each command's `--help` tail and the exit codes."""

from __future__ import annotations

import argparse
from typing import Any

from raypipe.run.watch import command as watch_command

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


def set_pairs(pairs: list[str]) -> dict[str, Any]:
    """`--set section.key=value` pairs as the nested settings tree the config loader layers."""
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


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A run command's `--set` pairs as a settings tree, `--force` as the take-over setting."""
    return set_pairs(args.set + (["output.take_over_lease=true"] if args.force else []))


def add_run_args(p: argparse.ArgumentParser, *, with_input: bool) -> None:
    """The flags every run command takes (backfill, daily, replay, watch)."""
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


def build_parser() -> argparse.ArgumentParser:
    """The whole `raypipe` parser, every command's `--help` tail included."""
    import raypipe.cli
    from serve_app.settings import PRECISION_SETTINGS, RUNTIME_SETTINGS

    parser = argparse.ArgumentParser(
        prog="raypipe",
        description=(raypipe.cli.__doc__ or "").split("\n\n")[0] + "\n\nEach command's flags: raypipe COMMAND --help.",
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
    add_run_args(backfill, with_input=True)
    backfill.add_argument("--run-id", help="names the run; the same id resumes it")

    daily = sub.add_parser("daily", help="classify paragraphs new or changed since the last daily run")
    add_run_args(daily, with_input=True)
    daily.add_argument("--run-id")
    daily.add_argument(
        "--since",
        help="ISO time with zone: also re-read the unchanged files read before, for their rows updated at or after "
        "it (a rerun over an earlier window; default: only new and changed files, each read whole)",
    )

    replay = sub.add_parser("replay", help="re-infer a run's dead letters into its results")
    add_run_args(replay, with_input=False)
    replay.add_argument("--run-id", required=True, help="the run whose dead letters to replay")
    replay.add_argument(
        "--replay-id",
        help="names the replay (default: resume the latest unfinished <run-id>.replay-<n>, else a new one)",
    )

    watch_command.add_parser(sub, add_run_args)

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

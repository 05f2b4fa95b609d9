"""`raypipe watch`: its arguments and its handler, registered by `raypipe.cli`.

    raypipe watch --input URI --output URI [--every 60s] [--max-wait 60s] [--events-queue URL]
                  [--config FILE] [--service HOST:PORT] [--set section.key=value] [--run-id ID]

Exit 0 once a SIGTERM or SIGINT stopped it gracefully (the lease released); 2 on a bad
configuration or input, as every command; 1 when it failed (the model service down past
`client.breaker.max_wait_s`, the output taken over).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

__all__ = ["EXAMPLES", "add_parser", "duration", "run"]

EXAMPLES = [
    "raypipe watch --input 's3://bucket/shards/' --output s3://bucket/out --every 60s",
    "raypipe watch --input ./incoming --output ./out --every 10s --max-wait 30s",
    "raypipe watch --input s3://bucket/shards/ --output s3://bucket/out --events-queue "
    "https://sqs.eu-west-1.amazonaws.com/123456789012/shards",
]

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration(value: str) -> float:
    """Seconds of a duration: `60`, `60s`, `2m`, `1.5h`, `500ms`."""
    match = _DURATION.fullmatch(value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration: give e.g. 60, 60s, 2m or 1h")
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


def add_parser(sub: Any, add_run_args: Callable[..., None]) -> argparse.ArgumentParser:
    """Adds `watch` to the command line's subparsers, with the run commands' common flags."""
    p: argparse.ArgumentParser = sub.add_parser(
        "watch", help="commit what arrives in the input, minutes after it arrives, until stopped"
    )
    add_run_args(p, with_input=True)
    p.add_argument("--every", type=duration, help="how often to look for new files (default watch.every_s, 60s)")
    p.add_argument(
        "--max-wait",
        type=duration,
        help="longest an arrival waits for more before it is committed (default watch.max_wait_s, 60s)",
    )
    p.add_argument("--events-queue", metavar="URL", help="SQS queue of the input's S3 event notifications")
    p.add_argument("--run-id", help="names the watcher (default: one per input, so a restart resumes it)")
    return p


def run(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    """Runs the watcher until a signal stops it; prints its report as JSON. 0 once stopped."""
    import json

    from raypipe import api

    report = api.watch(
        args.input,
        args.output,
        every_s=args.every,
        max_wait_s=args.max_wait,
        events_queue=args.events_queue,
        config=args.config,
        service=args.service,
        run_id=args.run_id,
        settings=settings,
    )
    print(json.dumps(report.to_dict(), indent=2))
    return 0

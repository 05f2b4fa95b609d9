"""The `raypipe` entry point: parse, set up logging, dispatch to the command, map errors to exit codes."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, NoReturn

from raypipe.cli.output import OUTPUT_COMMANDS, output_command, report_command
from raypipe.cli.parser import (
    EXIT_BAD_CONFIG,
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_STOPPED,
    build_parser,
    run_settings,
)
from raypipe.run.watch import command as watch_command


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
    args = build_parser().parse_args(argv)
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
            from raypipe.cli.model import model_command

            return model_command(args)
        if args.command == "serve":
            from raypipe.cli.serve import serve_command

            return serve_command(args)
        if args.command == "report":
            return report_command(args)
        if args.command in OUTPUT_COMMANDS:
            return output_command(args)
        if args.command == "watch":
            return watch_command.run(args, run_settings(args))
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


def _run(args: argparse.Namespace) -> int:
    from raypipe import api
    from raypipe.report import RunReport

    common: dict[str, Any] = {
        "service": args.service,
        "config_file": args.config,
        "settings": run_settings(args),
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

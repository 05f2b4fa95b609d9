"""The commands on an output rather than a run: `report`, `shards`, `lease`, `compact`, `vacuum`,
`migrate`."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from raypipe.cli.parser import EXIT_OK

if TYPE_CHECKING:
    from raypipe.commit.output import Output

OUTPUT_COMMANDS = ("shards", "lease", "compact", "vacuum", "migrate")
"""The commands `output_command` runs."""


def output_command(args: argparse.Namespace) -> int:
    """`raypipe shards|lease|compact|vacuum|migrate`: the command's exit code. The output is
    built once, here (a URI that is not one is a `ConfigError`: exit 2, nothing touched)."""
    from raypipe.commit.output import Output

    place = Output.at(args.output)
    if args.command == "shards":
        return _shards(args, place)
    if args.command == "lease":
        return _lease(args, place)
    return _maintain(args, place)


def _lease(args: argparse.Namespace, place: Output) -> int:
    from raypipe.commit.lease import Lease

    lease = Lease(place.store, "raypipe-cli")
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


def report_command(args: argparse.Namespace) -> int:
    from raypipe.api import report_dict
    from raypipe.report import RunReport

    data = report_dict(args.output, args.run_id)  # RunNotFoundError (a ConfigError): exit 2, naming the nearest
    print(json.dumps(data, indent=1) if args.json else RunReport.from_dict(data).render())
    return EXIT_OK


def _check_upkeep(args: argparse.Namespace, place: Output) -> None:
    """`ConfigError` where compact or migrate has nothing to work on: an output without the
    outcomes table (compact), or without runs of the earlier layout (migrate)."""
    from raypipe.commit.upkeep import LegacyLayout
    from raypipe.config import check_run_id
    from raypipe.errors import ConfigError

    for run_id in getattr(args, "run_id", None) or []:
        check_run_id(run_id, what="--run-id")
    if args.command == "compact" and not place.table.exists():
        raise ConfigError(f"output {args.output} holds no outcomes table: nothing to compact (check --output)")
    if args.command == "migrate" and not LegacyLayout(place.store).runs():
        raise ConfigError(
            f"output {args.output} holds no runs of the earlier layout (_raypipe/runs/): nothing to migrate "
            "(check --output)"
        )


def _shards(args: argparse.Namespace, place: Output) -> int:
    from raypipe.commit.upkeep import quarantine
    from raypipe.errors import ConfigError

    store = place.store
    if not store.fs.exists(store.path()):  # a mistyped output must not be created by it
        raise ConfigError(f"output {args.output} does not exist: give the output of the runs that read the shards")
    release = args.shards_command == "release"
    held = quarantine(place, args.shard, reason=getattr(args, "reason", ""), release=release)
    print(json.dumps({"quarantined": held}))
    return EXIT_OK


def _maintain(args: argparse.Namespace, place: Output) -> int:
    from raypipe.commit import upkeep
    from raypipe.errors import ConfigError

    _check_upkeep(args, place)
    if args.command == "compact":
        try:
            done = upkeep.compact(place, run_ids=args.run_id)
        except ValueError as e:  # runs named that have not finished
            raise ConfigError(f"compact: {e}; compact them once they finish") from None
    elif args.command == "vacuum":
        done = upkeep.vacuum(place, retention_hours=args.retention_hours, dry_run=args.dry_run, force=args.force)
    else:
        done = upkeep.migrate(place)
    print(json.dumps(done))
    return EXIT_OK

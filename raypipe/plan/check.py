"""The input as preflight checks it: listed, and its first shard planned (no row read)."""

from __future__ import annotations

import copy

from raypipe.config import InputConfig
from raypipe.errors import InputError, NoShardsError, SchemaError
from raypipe.plan.listing import list_input
from raypipe.plan.selection import bad_shard_policy, columns_of
from raypipe.plan.shards import plan_units
from raypipe.plan.units import ShardFormat

__all__ = ["check_input"]


# -- the input as preflight checks it ----------------------------------------------------------
_INPUT_HINT = "set --input (input.uri) to a Parquet or JSON-lines file, a folder of them, or a glob"


def check_input(input: InputConfig, mode: str, *, quarantined: frozenset[str] = frozenset()) -> None:
    """Raises `InputError` (or `NoShardsError`, `SchemaError`) with the setting to fix, if a run
    could not plan `input`: it exists, lists at least one shard (the `quarantined` ones left
    out), and its first shard has the id and text columns with usable types (its Parquet
    footer, or its first JSON line; no rows read). A daily records bad shards and goes on
    (`input.on_bad_shard: record`), so it is refused only when its first and its last shard
    both lack the same column: that is a setting (`input.text_column`), not one bad file."""
    try:
        listing = list_input(input.uri, format=input.format, quarantined=quarantined)
    except NoShardsError as e:
        raise NoShardsError(f"{e}: {_INPUT_HINT}") from e
    except (OSError, ValueError) as e:  # a bucket that does not exist, a path we may not list
        raise InputError(f"cannot list input {input.uri}: {type(e).__name__}: {e}: {_INPUT_HINT}") from e
    columns = columns_of(input)

    def first_error(shard: tuple[str, ShardFormat]) -> InputError | None:
        try:
            plan_units([shard], unit_rows=input.unit_rows, columns=columns, threads=1)
        except InputError as e:
            return e
        return None

    error = first_error(listing.shards[0])
    if error is None:
        return
    if bad_shard_policy(input, mode) == "record":
        # One bad file is the daily's to record; the same column missing at both ends is a setting.
        if not isinstance(error, SchemaError):
            return
        if len(listing.shards) > 1:
            last = first_error(listing.shards[-1])
            if not (isinstance(last, SchemaError) and last.column == error.column):
                return
    hinted = copy.copy(error)  # keeps its type and fields (shard, column)
    hinted.args = (f"{error}: {_schema_hint(error, input)}",)
    raise hinted from error


def _schema_hint(error: InputError, input: InputConfig) -> str:
    column = getattr(error, "column", None)
    setting = {
        input.id_column: "input.id_column",
        input.text_column: "input.text_column",
        input.updated_at_column: "input.updated_at_column",
    }.get(column or "")
    if setting is None:
        return "fix the shard, or quarantine it (raypipe shards quarantine)"
    return f"name the column with --set {setting}=NAME, or fix the shard"

"""The input columns raypipe needs, checked where a shard is first opened: at planning (its
footer or first JSON line, `raypipe.plan.planning`) or where its rows are read
(`raypipe.run.read`, for a shard planned whole from its listed size)."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from raypipe.errors import SchemaError
from raypipe.plan.units import ColumnNames

__all__ = ["check_columns", "check_types", "usable_id_type", "usable_text_type"]


def check_columns(names: Iterable[str], shard: str, columns: ColumnNames, need_updated_at: bool) -> None:
    present = set(names)
    required = [columns.id, columns.text] + ([columns.updated_at] if need_updated_at else [])
    for col in required:
        if col not in present:
            raise SchemaError(f"column {col!r} is missing; the shard has {sorted(present)}", shard=shard, column=col)


def _is_text_type(t: pa.DataType) -> bool:
    """A column of strings, however stored: any string or byte-string layout (Parquet byte arrays
    written without a UTF-8 annotation, as Hive and older Spark do, read as binary; each value's
    UTF-8 is checked when the unit is read), or a dictionary of them (pandas categoricals)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return any(
        check(t)
        for check in (
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_string_view,
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_binary_view,
        )
    )


def usable_id_type(t: pa.DataType) -> bool:
    """Strings, integers (their decimal strings), or nulls only (each row's `missing_id`)."""
    return _is_text_type(t) or pa.types.is_integer(t) or pa.types.is_null(t)


def usable_text_type(t: pa.DataType) -> bool:
    """Strings, or nulls only (each row's `empty_text`)."""
    return _is_text_type(t) or pa.types.is_null(t)


def check_types(schema: pa.Schema, shard: str, columns: ColumnNames) -> None:
    id_type = schema.field(columns.id).type
    if not usable_id_type(id_type):
        raise SchemaError(
            f"id column {columns.id!r} has type {id_type}; ids must be strings or integers",
            shard=shard,
            column=columns.id,
        )
    text_type = schema.field(columns.text).type
    if not usable_text_type(text_type):
        raise SchemaError(
            f"text column {columns.text!r} has type {text_type}; it must hold strings", shard=shard, column=columns.text
        )

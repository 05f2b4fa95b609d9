"""The input columns raypipe needs, checked where a shard is first opened: at planning (its
footer or first JSON line, `raypipe.plan.planning`) or where its rows are read
(`raypipe.run.read`, for a shard planned whole from its listed size)."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from raypipe.errors import SchemaError
from raypipe.plan.units import ColumnNames

__all__ = ["check_columns", "check_types"]


def check_columns(names: Iterable[str], shard: str, columns: ColumnNames, need_updated_at: bool) -> None:
    present = set(names)
    required = [columns.id, columns.text] + ([columns.updated_at] if need_updated_at else [])
    for col in required:
        if col not in present:
            raise SchemaError(f"column {col!r} is missing; the shard has {sorted(present)}", shard=shard, column=col)


def check_types(schema: pa.Schema, shard: str, columns: ColumnNames) -> None:
    id_type = schema.field(columns.id).type
    if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type) or pa.types.is_integer(id_type)):
        raise SchemaError(
            f"id column {columns.id!r} has type {id_type}; ids must be strings or integers",
            shard=shard,
            column=columns.id,
        )
    text_type = schema.field(columns.text).type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type) or pa.types.is_null(text_type)):
        raise SchemaError(
            f"text column {columns.text!r} has type {text_type}; it must hold strings", shard=shard, column=columns.text
        )

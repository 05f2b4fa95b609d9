"""The one place serve_app imports TensorFlow and transformers' TF models.

transformers 4.57 runs its TF models on tf-keras (Keras 2), not Keras 3, and TensorFlow
decides what ``tf.keras`` means at import time. So the environment must be set before the
first ``import tensorflow``; doing it here, lazily, keeps importing ``serve_app`` free of
work and keeps the setting in one place.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import cast


def tensorflow() -> ModuleType:
    """Return the ``tensorflow`` module, imported with serve_app's environment."""
    # setdefault: an operator's explicit choice wins.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    # C++ INFO/WARNING lines (oneDNN, CUDA stubs) would otherwise flood every replica log.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from protos.quiet import filtered_stderr

    # Importing TensorFlow and its first look for devices print CUDA lines on every CPU machine,
    # before absl's logging (and TF_CPP_MIN_LOG_LEVEL) applies; the filter drops only those.
    # Listing the GPUs initialises the devices, not the runtime: thread settings still apply.
    with filtered_stderr():
        import tensorflow as tf

        tf.config.list_physical_devices("GPU")
    return cast(ModuleType, tf)


@contextmanager
def quiet_loggers(*names: str, level: int = logging.WARNING) -> Iterator[None]:
    """Raise the named Python loggers to at least ``level`` for the block (TensorFlow, absl
    and converters log routine INFO and WARNING lines a user cannot act on)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), level))
    try:
        yield
    finally:
        for lg, old in zip(loggers, levels, strict=True):
            lg.setLevel(old)

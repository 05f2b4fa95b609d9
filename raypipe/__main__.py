"""`python -m raypipe ...`: the CLI, e.g. as a `ray job submit` entrypoint."""

from raypipe.cli import run

run()

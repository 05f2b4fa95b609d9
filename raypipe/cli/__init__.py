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

from raypipe.cli.entry import main, run

__all__ = ["main", "run"]

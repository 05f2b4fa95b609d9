"""The sections of a run's config besides the model service's: input, output, reuse, actors,
metrics, watch, and `PipelineConfig`, which holds them all."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from raypipe.config.base import Frozen
from raypipe.config.service import ClientConfig, ServiceConfig
from raypipe.errors import ConfigError


def validate_uri(uri: str) -> str:
    """Accepts `s3://bucket/prefix`, `file:///abs/path` or a local path; rejects the rest."""
    if not uri or not uri.strip():
        raise ValueError("must not be empty")
    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "s3a"):
        if not parsed.netloc:
            raise ValueError(f"{uri!r} has no bucket (expected s3://bucket/prefix)")
        return uri
    if parsed.scheme in ("", "file"):
        return uri
    if len(parsed.scheme) == 1:  # a Windows drive letter, not a scheme
        return uri
    raise ValueError(f"{uri!r}: scheme {parsed.scheme!r} is not supported (use s3:// or a local path)")


def output_uri(uri: str) -> str:
    """`validate_uri` for an output given outside a config (the API's and the CLI's named
    output, a reader's): a URI that is not one is a `ConfigError` naming the fix, raised before
    any filesystem is asked (fsspec would try, say, Google's metadata server for `gs://`)."""
    try:
        return validate_uri(uri)
    except ValueError as e:
        raise ConfigError(f"output: {e}") from None


class InputConfig(Frozen):
    uri: str = ""
    """Shards to read: a file, a folder or a glob; local or s3://. Empty here when the run call
    names it (`input=`, `--input`): `run_input` puts it over this section."""
    format: Literal["auto", "parquet", "jsonl"] = "auto"
    """Shard format; `auto` decides per file by its extension."""
    id_column: str = "id"
    """Column of each row's id: strings or integers (a row with a null id is a dead letter)."""
    text_column: str = "text"
    """Column of the paragraph to classify."""
    updated_at_column: str = "updated_at"
    """Column of each row's last-change time: daily runs pick new and changed rows by it; passed
    through to the results."""
    unit_rows: int = Field(2000, ge=1)
    """Rows per work unit, the grain of commits and of resume. Parquet row groups are kept whole:
    a unit is one or more of them, and only a group over `unit_bytes` is cut by rows (each
    piece re-reads the group)."""
    updated_at_partition: str | None = None
    """Hive partition key whose value is the date (YYYY-MM-DD) of its rows' updated_at, e.g.
    `updated_date` for `.../updated_date=2026-11-20/part-0.parquet`: a daily `--since` skips
    partitions before it without opening them. Row groups are pruned by their statistics anyway."""
    on_bad_shard: Literal["fail", "record"] | None = None
    """A shard that cannot be read or lacks a column: `fail` stops the run before inference
    (or when first read); `record` lists it in the report, leaves the run `incomplete` (exit 3),
    and goes on. Default: `fail` for a backfill, `record` for a daily (a bad shard must not hold
    the others back; every daily retries it until it reads or is quarantined)."""
    max_future_skew_s: float = Field(3600.0, ge=0)
    """An updated_at later than now plus this is in the future (a sentinel, a clock ahead): the
    row is inferred, the report counts it, and it never moves the watermark."""
    planning_threads: int = Field(16, ge=1)
    """Shards whose footers the driver reads at once while planning (one ranged GET each on
    S3): a 50k-shard backfill waits on 50k requests before its first unit. 1 plans them one
    after another; the plan is the same either way."""
    footer_sample: int | None = Field(1000, ge=1)
    """With more Parquet shards to read whole than this, planning reads this many footers
    (spread over the listing: schema checked, bytes per row measured) and plans each other
    shard of up to about 2 x `unit_rows` rows as one unit from its listed size; its footer is
    read with its rows (`raypipe.plan.planning.plan_listing`). Null reads every footer at planning."""
    unit_bytes: int = Field(64 * 2**20, ge=2**10)
    """Bytes of id, text and updated_at per work unit, beside `unit_rows`: a unit is one block
    in memory, so its size is bounded whatever the length of its texts. Parquet bytes are the
    footer's uncompressed sizes (a column of one text repeated, dictionary-encoded, reads
    larger); JSON-lines bytes are the file's. A Parquet row group over it is cut by rows (each
    piece re-reads the group); a JSON-lines file over it is cut at line boundaries after one
    pass over its lines at planning; a resumed plan's units cut for more are cut again."""

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        return validate_uri(v)


class OutputConfig(Frozen):
    uri: str | None = None
    """Where the outcomes table (`outcomes/`), run reports (`runs/`) and raypipe's state
    (`_raypipe/`) go; local or s3://. A run's named output (`--output`) goes over it; a run
    with neither is refused (`raypipe.commit.output.Output.for_run`)."""
    lease_s: float = Field(120.0, gt=0)
    """How long the output lease lasts without a heartbeat before another run may take it; a
    retried attempt of the same run waits for the earlier one's lease to lapse (see
    `lease_wait_s`)."""
    lease_wait_s: float = Field(600.0, gt=0)
    """How long a new attempt of a run waits for an earlier attempt that keeps renewing the
    lease (it is alive, or a zombie); past it, the run stops with `OutputLockedError` naming that
    attempt, and `--force` (`take_over_lease`) takes the run over at once."""
    take_over_lease: bool = False
    """Take a live lease of an earlier attempt of the same run at once (CLI `--force`), fencing
    that attempt off, instead of waiting for the lease to expire."""
    allow_model_change: bool = False
    """Let a run resume under another model version than it started with: its rows then carry
    both versions (the report names each). By default such a resume is refused (a model
    version covers everything that changes an answer), so one run's rows are one model's."""
    require_conditional_writes: bool = True
    """Refuse an S3 endpoint that ignores conditional writes (If-None-Match), where the lease
    could not keep two writers apart. Set false only if nothing else can write this output."""

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        return None if v is None else validate_uri(v)


#: Cluster CPUs per inference actor when `ActorPoolConfig.max_actors` is unset.
CPUS_PER_ACTOR = 16


def default_max_actors(cluster_cpus: float) -> int:
    """One actor per `CPUS_PER_ACTOR` CPUs of the cluster, at least one."""
    return max(1, int(cluster_cpus // CPUS_PER_ACTOR))


class DedupConfig(Frozen):
    """Answers reused by text hash (`raypipe.call.reuse`)."""

    enabled: bool = True
    """Rows whose text already has a committed answer of the same model version cost no call."""
    max_index_rows: int = Field(100_000_000, ge=0)
    """At most this many distinct texts' answers are held for the lookup (~33 bytes a text with
    6 labels, in Ray's object store: 3.3 GB at the default, which a 95M-text corpus fits; the
    driver holds only references), however many rows share them. With more, the index keeps
    this many (the smallest hashes) and the run infers the others again; the log says so and the
    report's `reuse_index` shows `capped` (`raypipe.call.reuse`)."""


class ActorPoolConfig(Frozen):
    min_actors: int = Field(1, ge=1)
    """Lower bound of the autoscaling actor pool (fewer when the run has fewer work units)."""
    max_actors: int | None = Field(None, ge=1)
    """Upper bound of the autoscaling actor pool. Unset: `default_max_actors` of the cluster's
    CPUs when the run starts (at least `min_actors`). One async actor keeps many calls in
    flight and spends a few ms of CPU per paragraph; on a small node a second one takes more
    CPU from the model than it adds in calls."""
    num_cpus: float = Field(0.25, gt=0)
    """CPUs reserved per actor; fractional, since the actors wait on I/O (whole CPUs can starve reads)."""
    units_per_actor: int = Field(2, ge=1)
    """Work units one actor handles at once (its async concurrency)."""

    @model_validator(mode="after")
    def _bounds(self) -> ActorPoolConfig:
        if self.max_actors is not None and self.min_actors > self.max_actors:
            raise ValueError(f"min_actors {self.min_actors} > max_actors {self.max_actors}")
        return self


class MetricsConfig(Frozen):
    dogstatsd_host: str | None = None
    """DogStatsD (Datadog agent) host; None or "" keeps Datadog metrics off. When the config is
    built from the environment, `DD_AGENT_HOST` is the default."""
    dogstatsd_port: int = Field(8125, gt=0, lt=65536)
    """DogStatsD UDP port; `DD_DOGSTATSD_PORT` is the default when built from the environment."""
    ray_metrics: bool = True
    """Also record the metrics with `ray.util.metrics` (Ray dashboard, Prometheus)."""
    namespace: str = "raypipe"
    """Prefix of every metric name (`raypipe.client.calls`; `raypipe_client_calls` in Ray)."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Extra tags on every metric (e.g. `env: prod`), besides run_id, mode, model_version, app."""
    gauge_interval_s: float = Field(5.0, gt=0)
    """How often each actor samples its breaker and in-flight limit into gauges."""

    @field_validator("dogstatsd_host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        return v.strip() or None if v is not None else None


class WatchConfig(Frozen):
    """`raypipe watch`: a long-lived driver that commits what arrives, unit by unit, as a daily does."""

    every_s: float = Field(60.0, gt=0)
    """How often the watcher looks for new input files (one listing; none with `events_queue`)."""
    max_wait_s: float = Field(60.0, ge=0)
    """The longest an arrival waits for more to join it: arrivals are cut into a commit when they
    reach `input.unit_rows` rows or `input.unit_bytes` bytes, or when the oldest has waited this long."""
    events_queue: str | None = None
    """An SQS queue URL of the input bucket's S3 event notifications: arrivals are read from it
    instead of listing the input at every tick (the input is listed once at the start)."""
    report_every_s: float = Field(300.0, gt=0)
    """How often the watcher writes its report (`OUTPUT/_raypipe/watch/<watch id>.json`)."""


class PipelineConfig(Frozen):
    output: OutputConfig = OutputConfig()
    """The output's settings; a run holds its output as `raypipe.commit.output.Output`, built
    from this and the run's named output, and reads them there."""
    input: InputConfig | None = None
    """Required by backfill and daily runs; a replay reads its run's dead letters instead."""
    service: ServiceConfig = ServiceConfig()
    client: ClientConfig = ClientConfig()
    actors: ActorPoolConfig = ActorPoolConfig()
    dedup: DedupConfig = DedupConfig()
    metrics: MetricsConfig = MetricsConfig()
    watch: WatchConfig = WatchConfig()
    run_id: str | None = None
    """Names the run; the same id resumes it. Default: `<mode>-<UTC timestamp>-<6 random hex digits>` (a new run)."""
    progress_interval_s: float = Field(10.0, gt=0)
    """How often progress is logged."""
    core_hour_usd: float = Field(0.04, ge=0)
    """Price of one CPU core for an hour, for the report's cost per million paragraphs (`raypipe.run.cost`);
    the default is about an on-demand cloud vCPU of a compute-optimised instance."""

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_run_id(v, what="")
            except ConfigError as e:
                raise ValueError(str(e)) from None
        return v


_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")


def check_run_id(value: str, *, what: str = "run id") -> str:
    """`value` when it may name a run: letters, digits, '.', '_' and '-', not starting with '.'
    (so never `..` or a path).
    Every id that names a file or folder of an output goes through here: a run's, a replay's,
    the run a replay or a report reads. Raises `ConfigError` (exit 2)."""
    if not _RUN_ID.fullmatch(value) or ".." in value:
        label = f"{what} " if what else ""
        raise ConfigError(f"{label}{value!r}: use letters, digits, '.', '_' and '-' (it names folders)")
    return value

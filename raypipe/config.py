"""One typed, frozen configuration for a run, validated before any data is read.

Settings come from three layers, later ones winning: a config file (YAML or JSON), the
environment (``RAYPIPE_<SECTION>__<FIELD>``, e.g. ``RAYPIPE_SERVICE__ADDRESS``), and explicit
overrides (CLI flags, keyword arguments of the Python API). Unknown keys are errors, never
ignored: a typo in a 96-hour job's config must fail in the first second.

Nothing here reads the environment or a file at import time; `load_config` does, when asked.
"""

from __future__ import annotations

import difflib
import json
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlparse

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from raypipe.errors import ConfigError

__all__ = [
    "ActorPoolConfig",
    "BreakerConfig",
    "ClientConfig",
    "InputConfig",
    "LimiterConfig",
    "MetricsConfig",
    "OutputConfig",
    "PipelineConfig",
    "RetryConfig",
    "ServiceConfig",
    "WatchConfig",
    "check_run_id",
    "load_config",
    "validate_uri",
]

ENV_PREFIX = "RAYPIPE_"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


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


_SCHEMES = {"grpc": False, "grpcs": True}
"""Address schemes and whether they mean TLS; an address without one follows `tls`."""


class ServiceConfig(_Frozen):
    address: str = "127.0.0.1:9000"
    """The model service: `host:port`, `grpc://host:port` (plaintext) or `grpcs://host:port`
    (TLS, as `tls: true`). The scheme is taken off when the config is built: `address` is then
    always `host:port` and `tls` says how to reach it."""
    tls: bool = False
    """Reach the service over TLS (a TLS-terminating sidecar or mesh in front of Serve's
    plaintext gRPC proxy). Implied by a `grpcs://` address; `false` with `grpcs://`, or `true`
    with `grpc://`, is an error."""
    ca_file: str | None = None
    """PEM bundle of the CA(s) to trust for the service's certificate; None trusts gRPC's
    default roots. Read once, when the config is built (on the driver): the certificates travel
    with the config to the actors, so only the driver needs the file. Needs TLS."""
    server_name: str | None = None
    """The name the service's certificate must match (and the TLS SNI), when it is not the
    address's host, e.g. a Kubernetes Service name while `address` is an IP. Needs TLS."""
    token_env: str | None = None
    """Name of an environment variable whose value is sent as `authorization: Bearer <value>`
    metadata on every call, for a sidecar that checks it. Its value is read by the process
    that makes the calls (the driver's up-front check and every inference actor), never
    carried in the config or Ray's task arguments: set it on the driver and on every node
    that runs actors (e.g. from one Kubernetes Secret in the head and worker pod templates).
    Needs TLS, so the token never crosses the network in the clear."""
    token_file: str | None = None
    """File holding the model service's token, sent as `authorization: Bearer <token>` on every
    call (the replicas check it). None: the file `raypipe serve` writes
    (`~/.raypipe/service-token`), sent when it exists; `RAYPIPE_SERVICE_TOKEN` in the
    environment wins over either. Read by the process that makes the calls, like `token_env`:
    the file must be on every node that runs actors (e.g. a Kubernetes Secret mounted there)."""
    application: str = "raypipe"
    """Serve application name, sent as the `application` metadata so the proxy can route."""
    timeout_s: float = Field(120.0, gt=0)
    """Floor of a Classify call's deadline. The deadline is the larger of this and
    `deadline_safety` x the time the call should take: this actor's work in flight with and
    ahead of it, over the rate at which the service has been answering it (Little's law),
    so a busy but healthy service never times out a call. Also the whole deadline until
    the rate is known: the first wave of every actor's calls queues at once, and on a small
    replica (bert-base on 2 cores) the last of that wave waits tens of seconds."""
    max_timeout_s: float = Field(600.0, gt=0)
    """Ceiling of a call's deadline, so a service that stopped answering is still noticed."""
    deadline_safety: float = Field(4.0, ge=1)
    """Multiple of the expected time a call gets before it is given up."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long the up-front reachability check waits before failing the run."""

    _ca_pem: bytes | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _scheme(cls, data: Any) -> Any:
        """Takes `grpc://` or `grpcs://` off the address and into `tls`."""
        if not isinstance(data, Mapping) or not isinstance(data.get("address"), str) or "://" not in data["address"]:
            return data
        scheme, _, rest = data["address"].partition("://")
        if scheme not in _SCHEMES:
            raise ValueError(
                f"address {data['address']!r}: scheme {scheme!r} is not supported (use grpc:// or grpcs://)"
            )
        tls = _SCHEMES[scheme]
        if "tls" in data:
            try:
                asked = TypeAdapter(bool).validate_python(data["tls"])
            except ValidationError:
                return {**data, "address": rest}  # the field's own validation reports the bad value
            if asked != tls:
                raise ValueError(
                    f"address {data['address']!r} says {'TLS' if tls else 'plaintext'} but tls is {str(asked).lower()}"
                )
        return {**data, "address": rest, "tls": tls}

    @field_validator("address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        if not re.fullmatch(r"\[?[\w.\-:]+\]?:\d{1,5}", v):
            raise ValueError(f"{v!r} is not host:port")
        return v

    @field_validator("server_name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9\-.]*[A-Za-z0-9])?", v):
            raise ValueError(f"{v!r} is not a host name")
        return v

    @field_validator("token_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        # Never echo the value: a token pasted here by mistake must not land in a log.
        if v is not None and (not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v) or _looks_like_a_token(v)):
            raise ValueError("must name an environment variable (letters, digits, _), not hold the token itself")
        return v

    @model_validator(mode="after")
    def _tls_settings(self, info: ValidationInfo) -> ServiceConfig:
        if not self.tls:
            given = [k for k in ("ca_file", "server_name", "token_env") if getattr(self, k) is not None]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} TLS: use a grpcs:// address or "
                    "tls: true" + (" (a token must not cross the network in the clear)" if "token_env" in given else "")
                )
        if self.ca_file is not None and not (info.context or {}).get("offline"):
            self._ca_pem = _read_ca_bundle(Path(self.ca_file))
        return self

    @property
    def ca_pem(self) -> bytes | None:
        """The certificates of `ca_file` (PEM), as read when the config was built."""
        return self._ca_pem


def _read_ca_bundle(path: Path) -> bytes:
    """The PEM bundle at `path`, checked to hold at least one certificate OpenSSL can load."""
    try:
        pem = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read CA file {path}: {e.strerror or e}") from e
    try:
        ssl.create_default_context(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError) as e:
        raise ValueError(f"CA file {path} holds no PEM certificate OpenSSL can load ({e})") from e
    return pem


class RetryConfig(_Frozen):
    max_attempts: int = Field(4, ge=1, le=20)
    """Attempts per call on a transient code; also the calls a micro-batch makes on service
    codes before a canary decides whether the service or the rows are at fault. Rows never
    become dead letters by this count (`raypipe.call.actor`)."""
    initial_backoff_s: float = Field(0.1, gt=0)
    """Scale of the exponential backoff (full jitter)."""
    max_backoff_s: float = Field(5.0, gt=0)
    """Cap of one backoff sleep."""


class BreakerConfig(_Frozen):
    failure_threshold: int = Field(5, ge=1)
    """Consecutive failed calls (per actor, each after its retries) that open the breaker; a
    call whose rows a canary showed at fault is no failure of the service (`raypipe.call.breaker`)."""
    reset_timeout_s: float = Field(1.0, gt=0)
    """Time open before one probe call is let through; doubles while probes fail."""
    max_reset_timeout_s: float = Field(30.0, gt=0)
    """Cap of the doubled reset timeout."""
    max_wait_s: float = Field(600.0, gt=0)
    """How long an outage may last, counted from the breaker's opening (failed probes
    included, however often a caller asks again); past it every waiting and new call gets
    `CircuitOpenError` and the run stops (exit 1) within `max_wait_s` plus one reset period,
    its rows still to do; rerunning the same run id resumes it. Nothing is dead-lettered for
    a service that is down."""


class LimiterConfig(_Frozen):
    kind: Literal["adaptive", "fixed"] = "adaptive"
    """`adaptive` finds the in-flight limit from the server's overload signals (AIMD);
    `fixed` holds `initial`."""
    initial: int = Field(2, ge=1)
    """Starting limit (the limit itself for `fixed`), per actor. Small: calls sent before the
    service's rate is measured get the deadline floor (`service.timeout_s`), and a call of 128
    paragraphs of bert-base takes tens of seconds on 2 cores; two calls of many forward passes
    each keep a replica's model threads busy, and the limit grows from there while the
    replica reports no work waiting."""
    min_limit: int = Field(2, ge=1)
    """Lower bound of the adaptive limit: one call in the replica's batch, one waiting."""
    max_limit: int = Field(64, ge=1)
    """Upper bound of the adaptive limit."""
    backoff_ratio: float = Field(0.9, gt=0, lt=1)
    """Multiplicative decrease on an overload signal."""
    queue_tolerance: int = Field(0, ge=0)
    """Whole batches a call may wait behind in the replica (beyond the running one) before
    it counts as overload; 0 keeps about one batch queued, enough to keep the model busy."""
    outside_slack_s: float = Field(0.25, gt=0)
    """Time a call may spend in front of the replica (proxy queue, network) before it counts
    as overload."""

    @model_validator(mode="after")
    def _bounds(self) -> LimiterConfig:
        if self.min_limit > self.max_limit:
            raise ValueError(f"min_limit {self.min_limit} > max_limit {self.max_limit}")
        if self.kind == "adaptive" and not self.min_limit <= self.initial <= self.max_limit:
            raise ValueError(f"initial {self.initial} is outside [{self.min_limit}, {self.max_limit}]")
        return self


class ClientConfig(_Frozen):
    max_text_bytes: int = Field(16 * 2**20, ge=1, le=16 * 2**20)
    """Largest text (UTF-8 bytes) that is sent; a longer one is a dead letter `too_large` with its
    size, never a call. At most 16 MiB, the bytes of text one call carries (the service refuses
    messages over 32 MiB); the model reads only its first `max_sequence_length` tokens anyway."""
    micro_batch_size: int = Field(128, ge=1, le=4096)
    """Most paragraphs per Classify call (1: one call per paragraph); a call also stops at
    16 MiB of text (`raypipe.call.actor.CALL_TEXT_BYTES`), so long documents go in smaller
    calls. A call costs the actor, Serve's proxy and the replica a fixed share besides its rows, and a
    call of many length-sorted rows splits into forward passes that pad little and spread
    evenly over the replica's model threads (docs/performance.md, "What a bigger call buys",
    measures 32, 64 and 128)."""
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    limiter: LimiterConfig = LimiterConfig()


class InputConfig(_Frozen):
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


class OutputConfig(_Frozen):
    uri: str
    """Where the outcomes table (`outcomes/`), run reports (`runs/`) and raypipe's state
    (`_raypipe/`) go; local or s3://."""
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
    def _uri(cls, v: str) -> str:
        return validate_uri(v)


#: Cluster CPUs per inference actor when `ActorPoolConfig.max_actors` is unset.
CPUS_PER_ACTOR = 16


def default_max_actors(cluster_cpus: float) -> int:
    """One actor per `CPUS_PER_ACTOR` CPUs of the cluster, at least one."""
    return max(1, int(cluster_cpus // CPUS_PER_ACTOR))


class DedupConfig(_Frozen):
    """Answers reused by text hash (`raypipe.call.dedup`)."""

    enabled: bool = True
    """Rows whose text already has a committed answer of the same model version cost no call."""
    max_index_rows: int = Field(100_000_000, ge=0)
    """At most this many distinct texts' answers are held for the lookup (~33 bytes a text with
    6 labels, in Ray's object store: 3.3 GB at the default, which a 95M-text corpus fits; the
    driver holds only references), however many rows share them. With more, the index keeps
    this many (the smallest hashes) and the run infers the others again; the log says so and the
    report's `reuse_index` shows `capped` (`raypipe.call.dedup`)."""


class ActorPoolConfig(_Frozen):
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


class MetricsConfig(_Frozen):
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


class WatchConfig(_Frozen):
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


class PipelineConfig(_Frozen):
    output: OutputConfig
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


def _looks_like_a_token(name: str) -> bool:
    """A value no one names a variable: long, and mixing lower-case letters with digits (a hex
    or base64 token), or longer than any variable name in use."""
    lower_and_digits = any(c.islower() for c in name) and sum(c.isdigit() for c in name) >= 4
    return len(name) > 64 or (len(name) >= 20 and lower_and_digits)


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


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        elif value is not None:
            out[key] = value
    return out


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _datadog_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """The Datadog agent's standard variables, as the lowest layer of `metrics`."""
    metrics = {
        key: environ[var]
        for key, var in (("dogstatsd_host", "DD_AGENT_HOST"), ("dogstatsd_port", "DD_DOGSTATSD_PORT"))
        if environ.get(var)
    }
    return {"metrics": metrics} if metrics else {}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at {e.start}): save it as UTF-8"
        ) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top, not {type(data).__name__}")
    return data


def _describe(err: ValidationError) -> str:
    """The errors on one line, each at its dotted path; an unknown key names the nearest valid one."""
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top)"
        if e["type"] == "extra_forbidden":
            near = _nearest_key(e["loc"])
            parts.append(f"{where}: unknown setting" + (f" (did you mean {near}?)" if near else ""))
        else:
            parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def _nearest_key(loc: tuple[int | str, ...]) -> str | None:
    """The valid dotted key closest to an unknown one (`input.unit_row` -> `input.unit_rows`)."""
    model: type[BaseModel] = PipelineConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        inner = _model_of(field.annotation) if field is not None else None
        if inner is None:
            return None
        model = inner
    near = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return ".".join([*(str(p) for p in loc[:-1]), near[0]]) if near else None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The config section an annotation holds (`InputConfig | None` -> `InputConfig`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def load_config(
    file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    offline: bool = False,
) -> PipelineConfig:
    """Builds the run's config from a file, the environment and overrides (in that order).

    `offline` checks a config for another machine (a manifest's entrypoint): files it names,
    such as `service.ca_file`, exist only there, so they are not read.

    Below them all, `DD_AGENT_HOST` and `DD_DOGSTATSD_PORT` in `environ` default the DogStatsD
    address (`metrics.dogstatsd_host`, `metrics.dogstatsd_port`)."""
    merged: dict[str, Any] = _datadog_defaults(environ) if environ is not None else {}
    if file is not None:
        merged = _deep_merge(merged, _read_file(Path(file)))
    if environ is not None:
        merged = _deep_merge(merged, _from_env(environ))
    if overrides:
        merged = _deep_merge(merged, overrides)
    try:
        return PipelineConfig.model_validate(merged, context={"offline": offline})
    except ValidationError as e:
        raise ConfigError("invalid configuration: " + _describe(e)) from e


def run_input(config: PipelineConfig, uri: str | None, mode: str) -> InputConfig:
    """The input of a backfill or a daily: the config's `input` section with `uri` (the run
    call's `input`, the CLI's `--input`) over its uri. Raises `ConfigError` when neither names one.

    The run calls keep the input apart from the rest of the run's config: only the preflight
    and planning read it (`raypipe.api`)."""
    section = config.input
    if uri is not None:
        fields = section.model_dump(exclude_unset=True) if section is not None else {}
        try:
            section = InputConfig(**{**fields, "uri": uri})
        except ValidationError as e:
            raise ConfigError("invalid configuration: input." + _describe(e)) from e
    if section is None or not section.uri:
        raise ConfigError(f"a {mode} needs an input: --input URI (or the setting input.uri)")
    return section

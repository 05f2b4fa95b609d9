"""The watch mode: the whole life of a watcher, step by step.

A watcher is a long-lived driver that commits what arrives in the input, unit by unit, under
one lease for its whole life, over the same steps a daily takes (`raypipe.run.modes`):

1. Ray joined (the warm actors need it) and SIGTERM/SIGINT turned into a graceful stop;
2. `ModelService.ask`: the service's labels, version and limits, before anything is written;
3. `CommitProtocol.setup_run`: the lease (a daily or backfill holding the output refuses the
   watcher, naming itself; a live watcher refuses them the same way) and the take-over;
4. the warm actors started (`raypipe.run.watch.warm`), with the text index of the answers
   committed so far (reuse);
5. `Watcher.resume`: the batch an earlier watcher of the same id left unfinished;
6. `Watcher.run`: the tick loop (`raypipe.run.watch.watcher`), until a stop;
7. the report written, the actors stopped, and the lease released, however it ended.

A first SIGTERM or SIGINT stops after the units in flight are committed; a second abandons
them (the output is fenced off from this attempt, so nothing of them lands) and stops at once.
Either way the lease is released and the watcher returns its report (the CLI exits 0).

    watch(config, input, ...)   the whole life of a watcher; returns its `WatchReport`
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from raypipe.call.actor import ActorSettings
from raypipe.call.metrics import RunMetrics
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol
from raypipe.config import InputConfig, PipelineConfig
from raypipe.errors import LeaseLostError, RunStopped
from raypipe.report import RunReport
from raypipe.run.watch.arrivals import ArrivalSource, EventArrivals, ListingArrivals
from raypipe.run.watch.report import WatchReport
from raypipe.run.watch.warm import UnitRunner, WarmActors
from raypipe.run.watch.watcher import Watcher, default_watch_id

__all__ = ["watch"]

logger = logging.getLogger("raypipe")


@contextlib.contextmanager
def _signals_stop(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set `stop` (finish the units in flight); a second raises `RunStopped`
    (abandon them). Only where Python delivers signals (the main thread); the previous
    handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise RunStopped(f"stopped by {signal.Signals(signum).name} again: the units in flight are abandoned")
        logger.info("watch: %s: stopping after the units in flight", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)


def watch(
    config: PipelineConfig,
    input: InputConfig,
    place: Output,
    *,
    stop: threading.Event | None = None,
    ticks: int | None = None,
    runner: Callable[[ActorSettings], UnitRunner] | None = None,
    events: Any = None,
) -> WatchReport:
    """Watches `input` and commits what arrives into `place` until `stop` is set (or a
    signal comes, or `ticks` looks were made); returns the report.

    `runner` builds what runs the units from the actors' settings (default: `WarmActors` on
    Ray); `events` is the S3 event queue to read (default: `watch.events_queue`'s, else a
    listing per tick)."""
    from raypipe.run.driver import ensure_ray
    from raypipe.run.steps import ModelService

    stop = stop or threading.Event()
    if runner is None:
        ensure_ray()  # first: `ray.init` installs its own SIGTERM handler, the watcher's goes over it
    watch_id = config.run_id or default_watch_id(input.uri)
    with _signals_stop(stop):
        model = ModelService.ask(config.service, config.client)
        protocol = CommitProtocol(place, "watch", watch_id)
        protocol.setup_run(model.labels)
        report = WatchReport(
            watch_id=watch_id,
            output=place.uri,
            input=input.uri,
            started_at=datetime.now(UTC).isoformat(),
            model_version=model.version,
            lease_holder=f"{watch_id} (attempt {protocol.attempt})",
        )
        units: UnitRunner | None = None
        watcher: Watcher | None = None
        write = True
        run_metrics: RunMetrics | None = None
        try:
            tags = RunReport(run_id=watch_id, mode="watch", output=place.uri, model_version=model.version)
            run_metrics = RunMetrics.start(config.metrics, tags, app=config.service.application)
            settings = ActorSettings(
                committer=protocol.unit_committer(),
                text_index=_text_index(config, protocol, model.version, model.labels, in_ray=runner is None),
                run_id=watch_id,
                attempt=protocol.attempt,
                service=config.service,
                client=model.client,
                labels=model.labels,
                model_version=model.version,
                metrics=run_metrics.spec,
            )
            units = runner(settings) if runner is not None else WarmActors(settings, config.actors)
            watcher = Watcher(
                protocol,
                input,
                config.watch,
                runner=units,
                source=_source(config, input, protocol, events),
                metrics=run_metrics.metrics,
                report=report,
                model_version=model.version,
            )
            watcher.stop = stop
            watcher.resume()
            watcher.write_report(close_window=False)
            logger.info("watch %s: watching %s every %g s", watch_id, input.uri, config.watch.every_s)
            watcher.run(ticks=ticks)
            report.status = "stopped"
        except LeaseLostError:
            write = False  # the holder that took the output over owns it now
            report.status = "failed"
            raise
        except RunStopped as e:
            report.status, report.error = "stopped", str(e)
            if protocol.abort():
                logger.info("watch %s: this attempt is fenced off; the units in flight land nothing", watch_id)
        except BaseException as e:
            report.status, report.error = "failed", f"{type(e).__name__}: {e}"
            with contextlib.suppress(Exception):
                protocol.abort()
            raise
        finally:
            try:
                if units is not None:
                    units.close()
                if write and watcher is not None:
                    watcher.write_report()
                if run_metrics is not None:
                    run_metrics.metrics.close()
                if events is None and watcher is not None and isinstance(watcher.source, EventArrivals):
                    watcher.source.queue.close()  # the queue client this watch opened
            finally:
                protocol.release()
    logger.info(
        "watch %s stopped: %d ticks, %d units, %d rows committed; the lease is released",
        watch_id,
        report.ticks,
        report.units,
        report.rows,
    )
    return report


def _text_index(
    config: PipelineConfig, protocol: CommitProtocol, version: str, labels: tuple[str, ...], *, in_ray: bool
) -> Any:
    """The answers committed before the watcher started, for reuse (as a daily builds it: from
    the stored index and what was committed since), built once; each actor adds the answers it
    commits afterwards (`TextIndex.add_committed`), so no tick builds it again."""
    if not config.dedup.enabled:
        return None
    from raypipe.call.reuse import TextIndex, build_index

    index, _ = build_index(protocol.table, version, labels, max_rows=config.dedup.max_index_rows, use_ray=in_ray)
    index = index or TextIndex.empty(version, labels)  # its own commits are added to it
    if not in_ray:
        return index
    import ray

    return ray.put(index)


def _source(config: PipelineConfig, input: InputConfig, protocol: CommitProtocol, events: Any) -> ArrivalSource:
    quarantined = protocol.quarantined()
    queue_url = config.watch.events_queue
    if events is None and queue_url:
        from raypipe.plan.events import SqsArrivals  # type: ignore[import-not-found,unused-ignore]

        events = SqsArrivals(queue_url, endpoint_url=None, region=None, storage_options=None)
    if events is not None:
        return EventArrivals(input, events, quarantined=quarantined)
    return ListingArrivals(input, quarantined)

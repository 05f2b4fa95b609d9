"""`raypipe serve`: deploy the EmotionClassifier Serve app, sized to the cluster it finds."""

from __future__ import annotations

import argparse
import logging
import sys

from raypipe.cli.parser import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_OK


def serve_command(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    import ray
    import yaml
    from ray import serve

    from serve_app.deploy import (
        DEFAULT_WAIT_S,
        POOL_RESOURCE,
        AppNotRunningError,
        Autoscaling,
        ControllerUnreachableError,
        DeploymentOptions,
        deploy,
        pool_nodes,
        size_replicas,
    )
    from serve_app.model import ModelDirError, read_model_card
    from serve_app.settings import ServerSettings

    # Checked before Ray starts: a wrong path or settings file is one line, not a cluster's log.
    settings = ServerSettings()
    try:
        read_model_card(args.model)
        if args.settings:
            with open(args.settings) as f:
                settings = ServerSettings.from_dict(yaml.safe_load(f))
    except (ModelDirError, OSError, ValueError, yaml.YAMLError) as e:
        print(f"raypipe: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    from protos.credential import CredentialError, default_token_file, ensure_token, token_digest

    try:
        token, created = ensure_token(args.token_file)
    except (CredentialError, OSError) as e:
        print(f"raypipe: --token-file: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if created:
        print(f"raypipe: wrote the service's token to {args.token_file or default_token_file()} (mode 600)", flush=True)
    if args.precision:
        settings = dataclasses.replace(settings, precision=args.precision)
    if args.runtime:
        settings = dataclasses.replace(settings, runtime=args.runtime)
    if args.force_precision:
        settings = dataclasses.replace(settings, force_precision=True)
    import os
    import threading

    from raypipe.run.driver import start_local_cluster, start_local_ray
    from raypipe.run.preflight import check_ray_address

    check_ray_address(os.environ)  # a RAY_ADDRESS nobody answers at: ray.init would retry for minutes
    if args.detach:
        try:
            start_local_ray(address="auto")
        except ConnectionError:
            # No cluster to join (RAY_ADDRESS unset, none running here): start a lean local one.
            try:
                start_local_cluster()
            except RuntimeError as e:
                print(f"raypipe: serve --detach found no Ray cluster and could not start one: {e}", file=sys.stderr)
                return EXIT_FAILED
            print("raypipe: started a local Ray cluster for the service (`ray stop` stops it)", flush=True)
            start_local_ray(address="auto")
    else:
        # In the foreground the replicas' own lines are the server's log: show them.
        start_local_ray(log_to_driver=True)
    # Nodes that advertise the pool resource take the replicas (the head and the jobs' nodes
    # do not); without any, the replicas go wherever the cluster has CPUs (one machine).
    pool = pool_nodes(ray.nodes())
    default_replicas, cpus, capacity = size_replicas(pool, ray.cluster_resources().get("CPU", 1.0), args.num_cpus)
    replicas = default_replicas if args.num_replicas is None else args.num_replicas
    autoscaling = None
    if replicas == "auto":
        autoscaling = Autoscaling(
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas or max(capacity, args.min_replicas),
            target_ongoing_requests=args.target_ongoing_requests,
            upscale_delay_s=args.upscale_delay_s,
            downscale_delay_s=args.downscale_delay_s,
            look_back_period_s=args.look_back_period_s,
        )
        replicas = args.min_replicas
    # Ray Data's cluster-wide helpers start while the replicas load, so the first run after
    # `raypipe serve` does not start them on its path; a failure there costs that run time only.
    warm = threading.Thread(target=_start_ray_data_helpers, name="serve-warm", daemon=True)
    warm.start()
    try:
        address = deploy(
            args.model,
            app_name=args.app_name,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            settings=settings,
            options=DeploymentOptions(
                num_replicas=int(replicas),
                autoscaling=autoscaling,
                resources=((POOL_RESOURCE, 1.0),) if pool else (),
                num_cpus=cpus,
                max_ongoing_requests=args.max_ongoing_requests,
                max_queued_requests=args.max_queued_requests,
            ),
            wait_s=args.wait_s or DEFAULT_WAIT_S,
            host=args.host,
            token_sha256=token_digest(token),
        )
    except AppNotRunningError as e:
        print(f"raypipe: {e} (it stays deployed; `serve status` follows it, --wait-s waits longer)", file=sys.stderr)
        return EXIT_FAILED
    except ControllerUnreachableError as e:
        print(f"raypipe: {e}", file=sys.stderr)
        return EXIT_FAILED
    warm.join(timeout=WARM_WAIT_S)
    shape = (
        f"{autoscaling.min_replicas}-{autoscaling.max_replicas} replicas (auto)"
        if autoscaling
        else f"{replicas} replica{'s' if replicas != 1 else ''}"
    )
    where = f" on {len(pool)} pool node{'s' if len(pool) != 1 else ''}" if pool else ""
    print(
        f"EmotionClassifier serving on {address} (application {args.app_name!r}): {shape} of {cpus:g} CPUs{where}",
        flush=True,
    )
    if args.detach:
        return EXIT_OK
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return EXIT_OK


#: How long `raypipe serve` waits, once its replicas run, for Ray Data's helpers to finish starting.
WARM_WAIT_S = 30.0


def _start_ray_data_helpers() -> None:
    """`start_ray_data_helpers` in serve's background thread: an optimization of the next run's
    start (which starts them itself where this did not), so a failure is a debug line only."""
    from raypipe.run.driver import start_ray_data_helpers

    try:
        start_ray_data_helpers()
    except Exception as e:
        logging.getLogger("raypipe").debug("Ray Data's helpers did not start ahead of the first run: %s", e)

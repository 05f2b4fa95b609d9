"""`raypipe watch`: the continuous delta mode, a daily's commits minutes after each arrival.

A long-lived driver commits what arrives in the input, unit by unit, under one lease for its
whole life, through the same fenced unit commits and the same files seen a daily uses. One
module per concept, in the order a watcher uses them:

    command     the CLI's `raypipe watch` (arguments, durations, handler)
    mode        `watch(config, input, ...)`: signals, service check, lease, warm actors,
                resume, the loop, the report, the lease released
    watcher     `Watcher`: a tick (look, plan arrivals, cut, commit), the loop, the report
    arrivals    where arrivals come from: a listing of the input, or S3 events through SQS
    coalesce    `Coalescer`: arrivals held until they are worth a commit (rows, bytes, age)
    warm        the inference actors that live as long as the watcher
    report      `WatchReport` and the freshness window (arrival to commit, p50/p95)

This package's face imports nothing: the CLI reads `command` without Ray Data.
"""

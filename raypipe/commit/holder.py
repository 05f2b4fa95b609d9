"""Who holds the output lease, as a process: told apart on this machine from any other process
that reuses its pid (`raypipe.commit.lease` takes a gone holder's lease over at once)."""

from __future__ import annotations

import os
import socket
from typing import Any

__all__ = ["holder_is_gone", "process_identity"]


def process_identity(pid: int) -> dict[str, str] | None:
    """Who process `pid` is on this machine: host, boot, pid namespace, pid and start time
    (clock ticks since boot), or None where that cannot be told (no `/proc`: not Linux).

    Read from `/proc` rather than psutil, which is no runtime dependency of raypipe; drivers
    run on Linux (KubeRay pods), and elsewhere a dead holder's lease lapses by itself."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: fields follow the last ')'.
    started = stat.rsplit(")", 1)[1].split()[19]
    return {"host": socket.gethostname(), "boot": boot, "pidns": pidns, "pid": str(pid), "started": started}


def holder_is_gone(record: dict[str, Any]) -> bool:
    """Is the lease's holder a process of this machine (host, boot, pid namespace) that no longer
    runs? False whenever that cannot be told: only a certain death skips the lease's expiry."""
    holder = record.get("process")
    me = process_identity(os.getpid())
    if not isinstance(holder, dict) or me is None or holder.get("pid") is None:
        return False
    if any(holder.get(k) != me[k] for k in ("host", "boot", "pidns")):
        return False
    now = process_identity(int(holder["pid"]))
    return now is None or now["started"] != holder.get("started")

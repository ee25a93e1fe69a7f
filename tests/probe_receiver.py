"""A receiving party in a process of its own, for tests that measure what a peer can make it hold.

    python probe_receiver.py FEDERATION NAME SETTINGS_JSON

Starts party NAME's transport (``GrpcTransport``, receive limits from SETTINGS ``limits``: the keys of
``ReceiveLimits``), prints ``ready`` once listening, resets the process's peak RSS (Linux: /proc/self/clear_refs),
then waits as a party does, for a ``kind`` message from ``sender`` (up to ``seconds``), taking it repeatedly
``takes`` times. It prints one JSON line: the RSS when ready, the peak since, the error that ended the wait (its
class and one line), how many messages it took and the median seconds a take of an already buffered message cost.
``nofile``: the process's file-descriptor limit (to show that idle connections cannot exhaust it).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    fed_path, name, settings = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    if settings.get("nofile"):
        resource.setrlimit(resource.RLIMIT_NOFILE, (settings["nofile"], settings["nofile"]))
    sys.path.insert(0, str(Path(__file__).parent))
    from test_deploy import _transport

    from secvfl.transport.grpc_link import ReceiveLimits

    transport = _transport(fed_path, name, timeout=float(settings.get("seconds", 60)),
                           peer_timeout=float(settings.get("peer_timeout", 30)), heartbeat=0.5)
    transport.set_limits(ReceiveLimits(**settings.get("limits", {})))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    ready_rss = _status("VmRSS")
    print("ready", flush=True)
    took, costs, error = 0, [], None
    try:
        if settings.get("wait_for_pending"):  # time takes of messages already here
            deadline = time.monotonic() + float(settings.get("seconds", 60))
            while transport.pending() < settings["wait_for_pending"] and time.monotonic() < deadline:
                time.sleep(0.05)
        while took < settings.get("takes", 1):
            t0 = time.perf_counter()
            transport.take(name_of(transport), kind=settings["kind"], sender=settings["sender"])
            costs.append(time.perf_counter() - t0)
            took += 1
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = {"type": type(exc).__name__, "text": str(exc)}
    peak = _status("VmHWM")
    print(json.dumps({"ready_rss": ready_rss, "peak_rss": peak, "error": error, "took": took,
                      "median_take_seconds": statistics.median(costs) if costs else None,
                      "pending": transport.pending()}), flush=True)
    transport.close(0.5)


def name_of(transport) -> str:  # noqa: ANN001
    return transport.local.name


if __name__ == "__main__":
    main()

"""CPU time to decode a valid message whose header is near the 4 MiB limit: a gradient whose meta names 500,000 row
ids (7-digit ids). Best of 5 decodes, thread CPU time. Used by BENCHMARKS.md ("Wire format").

    python scripts/decode_large_header.py
"""

from __future__ import annotations

import time

import torch

from secvfl.messages import MAX_HEADER_BYTES, Message, decode, encode


def main() -> None:
    data = encode(Message("gradient", "label", "party0", 1, {"gradient": torch.zeros(1, 1)},
                          meta={"rows": list(range(2_000_000, 2_500_000))}))
    times = []
    for _ in range(5):
        t0 = time.thread_time()
        decode(data)
        times.append(time.thread_time() - t0)
    print(f"message of {len(data):,} bytes (header limit {MAX_HEADER_BYTES:,}): decode best of 5 "
          f"{min(times) * 1000:.1f} ms CPU")


if __name__ == "__main__":
    main()

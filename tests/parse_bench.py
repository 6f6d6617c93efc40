"""The strict parse against json.loads, in-process, on the frames of issue 32's section 3.

Not collected by pytest (its name does not start with test_). Run it as
    python3 tests/parse_bench.py [runs]
It prints, for each frame, the best of ``runs`` timings of json.loads and of the proxy's
parse_json and parse_message, and the peak memory each adds while parsing (tracemalloc),
beside the frame's size.
"""

import json
import os
import random
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import agentrt_proxy as ap  # noqa: E402

MB = 1_000_000


def frames() -> dict[str, bytes]:
    rng = random.Random(32)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    lines, size = [], 0
    while size < MB:
        line = " ".join(rng.choice(words) for _ in range(12))
        lines.append(line)
        size += len(line) + 1
    text = "\n".join(lines)[:MB]
    entries = [{"name": f"file-{i}.txt", "type": "file", "size": rng.randrange(10 ** 7),
                "modified": "2026-12-01T10:00:00Z"} for i in range(20_000)]
    listing = json.dumps({"entries": entries}, indent=2)
    json_file = (listing * (4 * MB // len(listing) + 1))[:4 * MB]
    nested = json.dumps({"a": [[["[{" * 10 + "x" * 100] * 1000]]})
    return {
        "tools/call, 1 MB string argument": json.dumps(
            {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
             "params": {"name": "fs_write_file",
                        "arguments": {"path": "/tmp/out.txt", "content": text}}}).encode(),
        "answer, 4 MB JSON text": json.dumps(
            {"jsonrpc": "2.0", "id": 7,
             "result": {"content": [{"type": "text", "text": json_file}]}}).encode(),
        "answer, 20,000 entries": json.dumps(
            {"jsonrpc": "2.0", "id": 7,
             "result": {"content": [{"type": "text", "text": "listed"}],
                        "structuredContent": {"entries": entries}}}).encode(),
        "4 MB string of brackets": json.dumps({"s": "[{" * (2 * MB)}).encode(),
        "strings holding brackets": nested.encode(),
    }


def best_ms(fn, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def peak_mb(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / MB
    finally:
        tracemalloc.stop()


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    print(f"{'frame':36} {'MB':>6} | {'json.loads':>10} {'parse_json':>10} {'ratio':>5} "
          f"{'parse_message':>13} | peak MB: {'json':>6} {'ours':>6} {'message':>7}")
    for name, frame in frames().items():
        calls = {"json": lambda: json.loads(frame), "ours": lambda: ap.parse_json(frame),
                 "message": lambda: ap.parse_message(frame)}
        ms = {k: best_ms(f, runs) for k, f in calls.items()}
        peak = {k: peak_mb(f) for k, f in calls.items()}
        print(f"{name:36} {len(frame) / MB:6.2f} | {ms['json']:8.2f}ms {ms['ours']:8.2f}ms "
              f"{ms['ours'] / ms['json']:5.2f} {ms['message']:11.2f}ms | "
              f"{peak['json']:15.1f} {peak['ours']:6.1f} {peak['message']:7.1f}")


if __name__ == "__main__":
    main()

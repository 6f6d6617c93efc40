"""A bare relay, for tests/bench.py's floor: the plumbing any Python proxy on stdio pays.

    python3 tests/bare_relay.py SERVER_ARGV...

Starts the server and passes lines both ways unchanged, on one asyncio event loop as the
proxy does (each side's pipe watched by the loop, a line written as it is read): nothing is
parsed, checked or recorded. Not a proxy anyone should run: it gates nothing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

READ_CHUNK = 64 * 1024


def _write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _pump(loop: asyncio.AbstractEventLoop, src: int, dst: int, at_end) -> None:
    """Whole lines from ``src`` to ``dst`` as they come; ``at_end()`` at EOF."""
    held = [b""]

    def readable() -> None:
        chunk = os.read(src, READ_CHUNK)
        if not chunk:
            loop.remove_reader(src)
            at_end()
            return
        data = held[0] + chunk
        cut = data.rfind(b"\n") + 1
        held[0] = data[cut:]
        if cut:
            _write(dst, data[:cut])
    loop.add_reader(src, readable)


async def relay(argv: list[str]) -> int:
    server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    # The host's EOF closes the server's input; the server's EOF ends the relay.
    _pump(loop, sys.stdin.fileno(), server.stdin.fileno(), server.stdin.close)
    _pump(loop, server.stdout.fileno(), sys.stdout.fileno(), lambda: done.set_result(None))
    try:
        await done
    finally:
        if not server.stdin.closed:
            server.stdin.close()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(relay(sys.argv[1:])))

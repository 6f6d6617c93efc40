"""The host's pipes: read by a thread and written by a thread, so that the event loop never
waits on the host, with every line whole and in order.

- LineReader on a pipe and on a stream without a descriptor cuts the same lines: a long line
  cut at MAX_FRAME and the rest of it skipped, a last line without its line end, and EOF.
- Either way the host's input is read ahead by a bounded amount while nothing is taken.
- LineWriter writes messages of every size in the order written, without blocking its
  caller.
- A write to a host that is gone calls ``gone`` and drops what follows.
- A read that waits for the host does not block the loop; a pipe filled by another writer,
  or a socket whose send buffer has no room for an
  answer, does not block it either, and the answer still arrives whole and in order.
- A flood of empty lines is read ahead by a bounded amount too (each line counts
  READ_AHEAD_LINE_COST beyond its bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import agentrt_proxy as ap  # noqa: E402

WAIT = 10.0
LINE_BYTES = 16 * 1024
FLOOD_BYTES = 64 * 1024 * 1024      # four times MAX_FRAME, sent while nothing is taken
STALL = 1.0                         # no progress for this long: the reader holds back
BEATS, BEAT = 5, 0.01               # turns of the event loop, seconds each, while a read waits


class NoDescriptor:
    """A stream the loop cannot watch: only readline, as a file object without fileno."""

    def __init__(self, fd: int):
        self.file = os.fdopen(fd, "rb")

    def readline(self, size: int) -> bytes:
        return self.file.readline(size)

    def close(self) -> None:
        self.file.close()


def _read_all(stream_of, data: bytes) -> list:
    """Every line a LineReader gives for ``data`` written to a pipe."""
    r, w = os.pipe()

    def feed() -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(w, view[:65536]):]
        os.close(w)

    async def body():
        stream = stream_of(r)
        reader = ap.LineReader(stream, asyncio.get_running_loop())
        writer = threading.Thread(target=feed)
        writer.start()
        lines = []
        while True:
            line = await asyncio.wait_for(reader.next(), WAIT)
            lines.append(line)
            if line is None:
                break
        writer.join(WAIT)
        stream.close()
        return lines
    return asyncio.run(body())


STREAMS = {"pipe": lambda fd: os.fdopen(fd, "rb", buffering=0), "no descriptor": NoDescriptor}


@pytest.mark.parametrize("kind", list(STREAMS))
def test_the_reader_cuts_the_same_lines_either_way(kind):
    # Longer than MAX_FRAME by more than a read: it is passed on cut at MAX_FRAME + 1 bytes
    # (and then refused unparsed), the rest of it skipped up to its line end.
    long_line = b"x" * (ap.MAX_FRAME + 3 * ap.READ_CHUNK) + b"\n"
    data = b'{"a":1}\n\n' + long_line + b'{"b":2}\n' + b'{"c":3}'
    lines = _read_all(STREAMS[kind], data)
    assert lines[0] == b'{"a":1}\n'
    assert lines[1] == b"\n"
    assert len(lines[2]) == ap.MAX_FRAME + 1 and lines[2] == b"x" * (ap.MAX_FRAME + 1)
    assert lines[3:] == [b'{"b":2}\n', b'{"c":3}', None]


@pytest.mark.parametrize("kind", list(STREAMS))
@pytest.mark.parametrize("size", ["long lines", "empty lines"])
def test_the_reader_reads_ahead_a_bounded_amount_either_way(kind, size):
    r, w = os.pipe()
    os.set_blocking(w, False)
    line = b'{"jsonrpc":"2.0","method":"notifications/x","params":{"p":"' + \
        b"a" * (LINE_BYTES - 64) + b'"}}\n' if size == "long lines" else b"\n" * 4096
    # What the reader may hold: READ_AHEAD_BYTES counted with each line's cost, a read
    # past it, and the pipe's own buffer.
    bound = (FLOOD_BYTES if size == "long lines" else
             4 * ap.READ_AHEAD_BYTES // ap.READ_AHEAD_LINE_COST)

    def flood() -> int:
        sent, view, pos, last = 0, memoryview(line), 0, time.monotonic()
        while sent < FLOOD_BYTES and time.monotonic() - last < STALL:
            try:
                n = os.write(w, view[pos:])
            except BlockingIOError:
                time.sleep(0.005)
                continue
            sent, pos, last = sent + n, (pos + n) % len(line), time.monotonic()
        return sent

    async def body():
        stream = STREAMS[kind](r)
        reader = ap.LineReader(stream, asyncio.get_running_loop())
        try:
            sent = await asyncio.to_thread(flood)
        finally:
            os.close(w)
        taken = 0
        while (got := await reader.next()) is not None:     # body() has a deadline
            taken += len(got)             # read to its end: taking more reads more
        stream.close()
        return sent, taken
    sent, taken = asyncio.run(asyncio.wait_for(body(), 120))
    assert sent < bound, f"the reader took {sent} bytes while nothing was taken"
    assert taken == sent


def _writer(fd: int, gone=lambda: None) -> ap.LineWriter:
    return ap.LineWriter(os.fdopen(fd, "wb"), gone)


def _blocks(write) -> bool:
    """Whether ``write`` is still blocked after WAIT, run on a daemon thread so that a test
    of a write that blocks fails instead of hanging."""
    writing = threading.Thread(target=write, daemon=True)
    writing.start()
    writing.join(WAIT)
    return writing.is_alive()


def _read_pipe(fd: int, want: int) -> bytes:
    got = b""
    deadline = time.monotonic() + WAIT
    while len(got) < want and time.monotonic() < deadline:
        got += os.read(fd, 1 << 20)
    return got


def test_messages_of_every_size_are_written_in_order_without_blocking_the_caller():
    r, w = os.pipe()
    writer = _writer(w)
    size = 64 * 1024                      # more than the pipe holds: the thread blocks
    big = b"B" * (size - 1) + b"\n"
    small = [b'{"id":%d}\n' % i for i in range(50)]

    def write() -> None:
        writer.write(b"first\n")
        writer.write(big)
        for msg in small:
            writer.write(msg)
    blocked = _blocks(write)
    want = b"first\n" + big + b"".join(small)
    got = _read_pipe(r, len(want))
    assert not blocked, "a write while the thread was writing blocked its caller"
    assert got == want
    assert writer.drain(WAIT)
    os.close(r)


def test_a_write_to_a_host_that_is_gone_calls_gone_once_and_drops_the_rest():
    r, w = os.pipe()
    os.close(r)
    calls = []
    writer = _writer(w, lambda: calls.append(1))
    writer.write(b"one\n")
    writer.write(b"two\n")
    assert writer.drain(WAIT)
    assert calls == [1] and writer.broken


def test_a_writer_on_a_stream_without_a_descriptor_uses_its_thread():
    import io

    class Sink(io.BytesIO):
        def fileno(self):
            raise io.UnsupportedOperation("no descriptor")
    sink = Sink()
    writer = ap.LineWriter(sink, lambda: None)
    for i in range(20):
        writer.write(b"%d\n" % i)
    assert writer.drain(WAIT)
    assert sink.getvalue() == b"".join(b"%d\n" % i for i in range(20))


def test_a_read_that_waits_does_not_block_the_loop():
    """The reader waits for the host's next line: the line is written only once the loop has
    turned BEATS times more, so a reader that blocked the loop on its read would hold it
    until WAIT, when the line is written anyway."""
    r, w = os.pipe()
    went_on, in_time = threading.Event(), []

    def write_once_the_loop_goes_on() -> None:
        in_time.append(went_on.wait(WAIT))
        os.write(w, b'{"id":2}\n')

    async def beat() -> None:
        for _ in range(BEATS):
            await asyncio.sleep(BEAT)
        went_on.set()

    async def work():
        loop = asyncio.get_running_loop()
        reader = ap.LineReader(os.fdopen(r, "rb", buffering=0), loop)
        await asyncio.sleep(0.05)
        threading.Thread(target=write_once_the_loop_goes_on, daemon=True).start()
        beating = asyncio.create_task(beat())
        line = await reader.next()
        await beating
        return line
    line = asyncio.run(asyncio.wait_for(work(), 2 * WAIT))
    os.close(w)
    assert line == b'{"id":2}\n'
    assert in_time == [True], f"the event loop did not turn {BEATS} times while a read waited"


def test_a_pipe_filled_by_another_writer_does_not_block_the_loop():
    r, w = os.pipe()
    # Another process's hold on the pipe, filling it (a description of its own, so that
    # O_NONBLOCK is on it alone).
    other = os.open(f"/proc/self/fd/{w}", os.O_WRONLY | os.O_NONBLOCK)
    filled = 0
    try:
        while True:
            filled += os.write(other, b"o" * 4096)
    except BlockingIOError:
        pass
    writer = _writer(w)
    message = b'{"id":1,"result":{}}\n'
    blocked = _blocks(lambda: writer.write(message))      # nothing reads the pipe meanwhile
    got = _read_pipe(r, filled + len(message))
    assert not blocked
    assert got == b"o" * filled + message
    assert writer.drain(WAIT)
    os.close(other)
    os.close(r)


def test_a_socket_with_no_room_for_an_answer_does_not_block_nor_tear_it():
    """The host's socket with the smallest send buffer, nearly full: an answer of 4 KiB
    has no room. write() returns at once; the answer arrives whole, in order, once the
    host reads, and the host is not taken for gone."""
    import socket
    proxy_end, host_end = socket.socketpair()
    proxy_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)   # the kernel's minimum
    backlog = b""
    try:
        while True:
            sent = proxy_end.send(b"x" * 63 + b"\n", socket.MSG_DONTWAIT)
            backlog += (b"x" * 63 + b"\n")[:sent]
    except BlockingIOError:
        pass
    gone = []
    writer = ap.LineWriter(os.fdopen(os.dup(proxy_end.fileno()), "wb"),
                           lambda: gone.append(True))
    answers = [b'{"id":%d,"result":"' % i + b"y" * 4000 + b'"}\n' for i in range(3)]
    blocked = _blocks(lambda: [writer.write(a) for a in answers])
    host_end.settimeout(WAIT)
    want = backlog + b"".join(answers)
    got = b""
    while len(got) < len(want):
        chunk = host_end.recv(65536)
        if not chunk:
            break
        got += chunk
    assert not blocked, "a write to a socket with no room blocked its caller"
    assert got == want and not gone and not writer.broken
    assert writer.drain(WAIT)
    proxy_end.close()
    host_end.close()


def test_an_output_made_non_blocking_by_its_holder_gets_every_answer_whole():
    """The host (or another holder of the pipe) set O_NONBLOCK on the output's description:
    what the writer's thread writes waits for room, never counting the host as gone."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    gone = []
    writer = _writer(w, lambda: gone.append(True))
    answers = [b'{"id":%d,"result":"' % i + b"z" * 50_000 + b'"}\n' for i in range(4)]
    for answer in answers:
        writer.write(answer)
    want = b"".join(answers)
    got = b""
    os.set_blocking(r, False)
    deadline = time.monotonic() + WAIT
    while len(got) < len(want) and time.monotonic() < deadline:
        time.sleep(0.01)                          # a slow host
        with contextlib.suppress(BlockingIOError):
            got += os.read(r, 8192)
    assert got == want and not gone and not writer.broken
    assert writer.drain(WAIT)
    os.close(r)

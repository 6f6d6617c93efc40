"""A stand-in payment server for the demo and the tests: an MCP server, standard library only.

    python fake_payment_server.py        # serves MCP over stdio until stdin closes

It offers three tools and moves no money. Each payment that reaches it is written to a
ledger file first, so a test can count what the server really did (one line per payment).

Tools
-----
- ``balance {account}``: read-only hint; answers ``account <account> holds 120.00 EUR``.
- ``pay {to, amount, currency?, mode?}``: annotations ``{"destructiveHint": false}``. When
  ``FAKE_PAYMENTS_LEDGER`` names a file, the raw ``arguments`` JSON as received plus ``\\n``
  is appended to it (created 0600, one process-wide lock, flushed and fsynced) *before* the
  answer, in every mode. Then, by ``mode``:

  - (none, or any other value): text ``paid <amount, 2 decimals> to <to>``;
  - ``slow``: waits 2 s, or until the request is cancelled, then answers as above;
  - ``block``: polls every 20 ms until ``<ledger>.release`` exists, then answers as above;
    cancelled first, it answers a JSON-RPC error (-32000 ``request cancelled``). Without a
    ledger it waits for the cancellation;
  - ``error``: an ``isError`` result, text ``card declined for <to>``;
  - ``structured``: the text above plus structuredContent ``{"paid": amount, "to": to}``;
  - ``deep``: text ``deep`` plus structuredContent ``{"nested": V}``, V being
    ``{"paid": amount}`` inside 300 nested one-element arrays.

  A ``to`` that is not a string or an ``amount`` that is not a number is a protocol error
  (-32602), and nothing is recorded.
- ``refund {payment}``: no annotations at all; answers ``refunded``.

``FAKE_PAYMENTS_DESCRIPTION``, when set, replaces ``balance``'s description (a server that
changed since it was pinned).

Protocol eras
-------------
Legacy (``initialize``, versions 2024-11-05 .. 2025-11-25): the requested version is echoed
when supported, else ``2025-11-25``; ``ping`` answers ``{}``; results carry no ``resultType``.

Modern (2026-07-28): every request carries ``_meta`` with
``io.modelcontextprotocol/protocolVersion`` and ``io.modelcontextprotocol/clientCapabilities``
(either missing: -32602); another version gets -32022 with ``data: {supported, requested}``.
``server/discover`` lists only ``["2026-07-28"]`` in ``supportedVersions``, as the Python
SDK's dual-era server does (a legacy version cannot be used in ``_meta``, so listing one
would invite a request that fails). Results carry ``resultType: "complete"``; ``tools/list``
and ``server/discover`` also carry ``ttlMs: 0`` and ``cacheScope: "private"``; the discover
result names the server both as ``serverInfo`` and in ``_meta``. ``ping`` is -32601.

On stdio the era of a connection is fixed by its first request that shows one, as the Python
SDK does: ``initialize`` makes it legacy; an accepted request carrying the ``_meta`` version
(``server/discover`` included) makes it modern. A request refused for its ``_meta``
(-32022, -32602) fixes nothing, so a client may still fall back to ``initialize``. Before
either, other requests are served leniently as legacy. Once modern, ``initialize`` gets
-32022 ("connection is serving the 2026-07-28 protocol"). Once legacy, the connection
behaves as a legacy-only server: ``server/discover`` gets -32601 and ``_meta`` versions on
other requests are ignored.
``FAKE_PAYMENTS_ERA=legacy|modern`` fixes the era from the start (a single-era server).

Everywhere: a line that is not JSON gets -32700 (id null) and serving goes on; an unknown
method gets -32601; notifications are ignored except ``notifications/cancelled``, which
cancels the named in-flight call. Each ``tools/call`` and ``tasks/result`` runs in its own
thread, so a blocked payment holds up nothing else; answers may come in any order, each
written as one line.
When stdin closes, calls still running are cancelled (``slow`` answers at once, ``block``
answers the cancellation error), given up to 2 s to answer, and the process exits 0.

Tasks mode
----------
Off unless ``FAKE_PAYMENTS_TASKS`` is ``optional`` or ``required``; off, nothing above changes.
On, the server is a task receiver in both eras (the two are not wire-compatible):

- it advertises: 2025-11-25 ``initialize`` ``capabilities.tasks = {cancel: {}, requests:
  {tools: {call: {}}}}`` and ``execution.taskSupport`` (the mode) on ``pay`` and ``refund``;
  2026-07-28 ``server/discover`` ``capabilities.extensions["io.modelcontextprotocol/tasks"] =
  {}``. ``pay``'s mode enum gains ``input``.
- A ``pay``/``refund`` call that asks for a task (2025-11-25: ``params.task`` present;
  2026-07-28: the request's own client capabilities declare the extension) is answered a
  CreateTaskResult (``{task: Task}``; ``{resultType: "task", ...Task}``) once the task is on
  disk: a random ``taskId``, ``working``, ``createdAt``/``lastUpdatedAt`` (UTC, ms), ``ttl`` /
  ``ttlMs`` (``FAKE_PAYMENTS_TASK_TTL_MS``, default 3600000), ``pollInterval`` /
  ``pollIntervalMs`` 100. The call then runs in the background exactly as a plain one (same
  ledger line, same modes); its result makes the task ``completed`` (an ``isError`` result
  too), a JSON-RPC error makes it ``failed`` with ``error``. ``balance`` is never a task
  (2025-11-25: asking is -32601). With ``required``, a plain ``pay``/``refund`` gets -32601
  (2025-11-25) or -32021 with ``data.requiredCapabilities`` (2026-07-28).
- ``pay`` mode ``input`` (tasks only; a plain call gets -32602): the task is
  ``input_required`` (2026-07-28 with ``inputRequests`` holding one ``elicitation/create``)
  until cancelled, and nothing is paid. Input sent back is not read.
- ``tasks/get`` (2026-07-28: ``resultType: "complete"``, with ``result`` when completed,
  ``error`` when failed, ``inputRequests`` when waiting for input); ``tasks/result``
  (2025-11-25 only: blocks until terminal, answers the result with ``_meta`` related-task, or
  the error; a cancelled task -32000); ``tasks/cancel`` (2025-11-25: the Task, ``cancelled``;
  -32602 when already terminal; 2026-07-28: an empty acknowledgement). A cancel stops a
  ``slow``/``block`` wait and undoes no ledger line. Unknown or expired ids: -32602. On
  2026-07-28 a ``tasks/*`` request that does not declare the extension gets -32021.
- Durable: every task is kept in ``FAKE_PAYMENTS_TASKS_FILE`` (default
  ``<ledger>.tasks.json``; in memory without a ledger), rewritten whole (temp file, fsync,
  rename) under an exclusive lock on ``<file>.lock``, so several servers may share it. Just
  before a payment's ledger line is written, its task notes the result it will have and
  where the ledger ended. A server answering for a task whose process is gone settles it:
  its noted line in the ledger, it is ``completed`` with the noted result at once (``block``:
  once ``<ledger>.release`` exists); otherwise ``failed``, the server having restarted before
  running it. ``FAKE_PAYMENTS_TASKS_FORGET=1`` keeps tasks in memory only: a restarted
  server knows none of the earlier ones (-32602).

For reuse (tests/mcp_http_server.py serves the same tools over HTTP)::

    server = FakePayments(ledger=None, description=None)   # or FakePayments.from_env()
    # tasks mode: FakePayments(ledger, description, tasks="optional"|"required",
    #                          tasks_file=None, ttl_ms=TASK_TTL_MS, forget=False)
    server.handle(method, params, era="legacy"|"modern", raw_args=None, cancelled=None) -> dict
        # raises RPCError(code, message, data); raw_args: the bytes of params.arguments
    raw_arguments(message: bytes) -> bytes | None         # that span, taken from a message
    check_modern_meta(params) -> None                      # raises -32602 / -32022
"""

import contextlib
import fcntl
import json
import os
import re
import secrets
import sys
import threading
import time

PROGRAM = "fake_payment_server.py"
# The Python agentrt_proxy needs, checked first: an older one stops with one line saying what to
# use (the same line as agentrt_proxy.py's), not with a traceback.
if sys.version_info < (3, 9):
    sys.exit("%s needs Python 3.9 or newer; this is Python %s (%s). Get one: on macOS, "
             "/usr/bin/python3 from the Command Line Tools (xcode-select --install; update them "
             "if it is older than 3.9), Homebrew's python (brew install python), or the "
             "installer from https://www.python.org/downloads/"
             % (PROGRAM, sys.version.split()[0], sys.executable))

SERVER_INFO = {"name": "fake-payments", "version": "1.0.0"}
LEGACY_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
MODERN_VERSION = "2026-07-28"
MODERN_VERSIONS = (MODERN_VERSION,)
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT = "io.modelcontextprotocol/clientInfo"
META_SERVER = "io.modelcontextprotocol/serverInfo"

META_RELATED_TASK = "io.modelcontextprotocol/related-task"
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
INTERNAL_ERROR = -32603
CANCELLED = -32000
HEADER_MISMATCH, MISSING_CAPABILITY, UNSUPPORTED_VERSION = -32020, -32021, -32022

SLOW_SECONDS = 2.0
POLL_SECONDS = 0.02
DEEP_LEVELS = 300
PAY_MODES = ["slow", "block", "error", "structured", "deep"]
INPUT_MODE = "input"  # a pay mode only a server in tasks mode offers

TASK_MODES = ("optional", "required")  # FAKE_PAYMENTS_TASKS: the tools' taskSupport
TASK_TOOLS = ("pay", "refund")
TASK_TTL_MS = 3600000  # FAKE_PAYMENTS_TASK_TTL_MS unless set
TASK_POLL_MS = 100
TASK_ID_BYTES = 16
TERMINAL = ("completed", "failed", "cancelled")
RESTARTED = "the server restarted before running this call"
# What a task of pay mode "input" waits for (2026-07-28 inputRequests): one elicitation.
INPUT_REQUESTS = {"confirm": {"method": "elicitation/create", "params": {
    "mode": "form", "message": "Confirm this payment.",
    "requestedSchema": {"type": "object", "properties": {"confirm": {"type": "boolean"}},
                        "required": ["confirm"]}}}}

LEDGER_LOCK = threading.Lock()  # one per process: every ledger append goes through it


class RPCError(Exception):
    """A JSON-RPC error answer."""

    def __init__(self, code: int, message: str, data=None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def error(self) -> dict:
        e = {"code": self.code, "message": self.message}
        if self.data is not None:
            e["data"] = self.data
        return e


def modern_version(params):
    """The ``_meta`` protocol version a request carries, or None."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    return meta.get(META_VERSION) if isinstance(meta, dict) else None


def check_modern_meta(params) -> None:
    """Refuse a 2026-07-28 request whose ``_meta`` lacks a required key or names a version
    this server does not speak."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get(META_VERSION), str):
        raise RPCError(INVALID_PARAMS, f"missing _meta {META_VERSION}")
    version = meta[META_VERSION]
    if version not in MODERN_VERSIONS:
        raise RPCError(UNSUPPORTED_VERSION, f"unsupported protocol version {version}",
                       {"supported": list(MODERN_VERSIONS), "requested": version})
    if not isinstance(meta.get(META_CAPABILITIES), dict):
        raise RPCError(INVALID_PARAMS, f"missing _meta {META_CAPABILITIES}")


# --- the raw bytes of params.arguments -------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _span(text: str, i: int, path: tuple):
    """(span of the value at ``path`` inside the value starting at text[i], end of that value).
    The span is None when the path is absent; the last duplicate key wins, as in json.loads."""
    if not path:
        end = _DECODER.raw_decode(text, i)[1]
        return (i, end), end
    if text[i] != "{":
        return None, _DECODER.raw_decode(text, i)[1]
    found = None
    i = _WS.match(text, i + 1).end()
    if text[i] == "}":
        return None, i + 1
    while True:
        key, i = json.decoder.scanstring(text, i + 1)
        i = _WS.match(text, _WS.match(text, i).end() + 1).end()  # past ':'
        if key == path[0]:
            found, i = _span(text, i, path[1:])
        else:
            i = _DECODER.raw_decode(text, i)[1]
        i = _WS.match(text, i).end()
        if text[i] == "}":
            return found, i + 1
        i = _WS.match(text, i + 1).end()  # past ','


def raw_arguments(message: bytes):
    """The exact bytes of ``params.arguments`` in a JSON-RPC message (valid UTF-8 JSON), or None."""
    text = message.decode("utf-8")
    start = _WS.match(text).end()
    span = _span(text, start, ("params", "arguments"))[0]
    return text[span[0]:span[1]].encode("utf-8") if span else None


# --- the tools --------------------------------------------------------------------------------

def _text(text: str, is_error: bool = False) -> dict:
    result = {"content": [{"type": "text", "text": text}]}
    if is_error:
        result["isError"] = True
    return result


# --- tasks -----------------------------------------------------------------------------------

def _rfc3339(t: float) -> str:
    """UTC with milliseconds: a requester compares createdAt with when it sent the call."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".%03dZ" % (int(t * 1000) % 1000)


def _alive(pid: int) -> bool:
    """Whether the process that created a task still runs it (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def task_view(task: dict, era: str) -> dict:
    """The Task a requester sees, named as its era names the members."""
    legacy = era == "legacy"
    view = {"taskId": task["taskId"], "status": task["status"],
            "createdAt": _rfc3339(task["created"]), "lastUpdatedAt": _rfc3339(task["updated"]),
            "ttl" if legacy else "ttlMs": task["ttlMs"],
            "pollInterval" if legacy else "pollIntervalMs": TASK_POLL_MS}
    if "statusMessage" in task:
        view["statusMessage"] = task["statusMessage"]
    return view


def declares_tasks(params: dict) -> bool:
    """Whether a 2026-07-28 request declares the tasks extension in its own capabilities."""
    meta = params.get("_meta")
    capabilities = meta.get(META_CAPABILITIES) if isinstance(meta, dict) else None
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    return isinstance(extensions, dict) and isinstance(extensions.get(TASKS_EXTENSION), dict)


class TaskStore:
    """Every task, in one JSON file that each server process on it reads and rewrites whole
    (temp file, fsync, rename) under an exclusive lock, or in memory when there is no file.
    A task records the process that runs it; a task whose process is gone is settled from the
    ledger when it is next looked at (see ``settle``)."""

    def __init__(self, path, ledger, ttl_ms: int):
        self.path, self.ledger, self.ttl_ms = path, ledger, ttl_ms
        self.lock = threading.Lock()  # this process's threads, around the file lock
        self.memory = {}              # the tasks, when there is no file
        self.stops = {}               # taskId -> Event, for the tasks this process runs

    @contextlib.contextmanager
    def tasks(self):
        """The tasks by id, to read and change; a change is on disk when the block ends.
        Expired tasks are gone."""
        with self.lock:
            if not self.path:
                self.prune(self.memory)
                yield self.memory
                return
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    with open(self.path, "rb") as f:
                        tasks = json.load(f)["tasks"]
                except FileNotFoundError:
                    tasks = {}
                before = json.dumps(tasks, sort_keys=True)
                self.prune(tasks)
                yield tasks
                if json.dumps(tasks, sort_keys=True) != before:
                    self.write(tasks)
            finally:
                os.close(fd)

    @staticmethod
    def prune(tasks: dict) -> None:
        now = time.time()
        for task_id in [k for k, t in tasks.items()
                        if now > t["created"] + t["ttlMs"] / 1000.0]:
            del tasks[task_id]

    def write(self, tasks: dict) -> None:
        data = json.dumps({"tasks": tasks}, separators=(",", ":")).encode()
        temp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, self.path)
        fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)

    def create(self, **fields) -> dict:
        now = time.time()
        task = dict(fields, taskId=secrets.token_hex(TASK_ID_BYTES), created=now, updated=now,
                    ttlMs=self.ttl_ms, pid=os.getpid())
        task.setdefault("status", "working")
        with self.tasks() as tasks:
            tasks[task["taskId"]] = task
        return dict(task)

    def change(self, task_id: str, **fields) -> bool:
        """Change a task that is not terminal (a terminal one never changes): whether it was."""
        with self.tasks() as tasks:
            task = tasks.get(task_id)
            if task is None or task["status"] in TERMINAL:
                return False
            task.update(fields, updated=time.time())
            return True

    def look(self, task_id) -> dict:
        """The task now; an unknown or expired id: -32602."""
        with self.tasks() as tasks:
            return dict(self.found(tasks, task_id))

    def cancel(self, task_id):
        """(the task, whether this cancelled it): a terminal task stays as it is. A payment
        already in the ledger stays there."""
        with self.tasks() as tasks:
            task = self.found(tasks, task_id)
            if task["status"] in TERMINAL:
                return dict(task), False
            task.update(status="cancelled", updated=time.time())
            task.pop("statusMessage", None)
            self.stops.get(task_id, threading.Event()).set()
            return dict(task), True

    def found(self, tasks: dict, task_id) -> dict:
        task = tasks.get(task_id) if isinstance(task_id, str) else None
        if task is None:
            raise RPCError(INVALID_PARAMS, f"unknown task: {task_id}")
        self.settle(task)
        return task

    def wait(self, task_id, cancelled: threading.Event) -> dict:
        """The task once terminal (tasks/result blocks so)."""
        while True:
            task = self.look(task_id)
            if task["status"] in TERMINAL:
                return task
            if cancelled.wait(POLL_SECONDS):
                raise RPCError(CANCELLED, "request cancelled")

    def settle(self, task: dict) -> None:
        """A working task whose process is gone: ``completed`` with the result it noted when
        its payment is in the ledger (a block one once released), else ``failed``."""
        if task["status"] != "working" or task["pid"] == os.getpid() or _alive(task["pid"]):
            return
        intent = task.get("intent")
        if intent is None or not self.in_ledger(intent):
            task.update(status="failed", statusMessage=RESTARTED, updated=time.time(),
                        error={"code": INTERNAL_ERROR, "message": RESTARTED})
        elif intent["mode"] != "block" or (self.ledger and
                                           os.path.exists(self.ledger + ".release")):
            task.update(status="completed", result=intent["result"], updated=time.time())

    def in_ledger(self, intent: dict) -> bool:
        """Whether the noted line is in the ledger, at or after where the ledger ended when it
        was noted (written whole: a line ends with its newline)."""
        if intent["line"] is None:
            return True  # nothing is written for it
        try:
            with open(self.ledger, "rb") as f:
                f.seek(intent["from"])
                lines = f.read().split(b"\n")[:-1]
        except OSError:
            return False
        return intent["line"].encode("utf-8", "surrogateescape") in lines

    def intent(self, result: dict, mode, raw_args) -> dict:
        """What a task notes just before its payment reaches the ledger."""
        if raw_args is None or not self.ledger:
            return {"result": result, "mode": mode, "line": None, "from": 0}
        try:
            end = os.path.getsize(self.ledger)
        except FileNotFoundError:
            end = 0
        return {"result": result, "mode": mode, "from": end,
                "line": raw_args.decode("utf-8", "surrogateescape")}



class FakePayments:
    """The tools and the method table, independent of any transport."""

    def __init__(self, ledger=None, description=None, tasks=None, tasks_file=None,
                 ttl_ms: int = TASK_TTL_MS, forget: bool = False):
        self.ledger = ledger or None
        self.description = description
        self.tasks = tasks if tasks in TASK_MODES else None
        self.store = None
        if self.tasks:
            path = tasks_file or (self.ledger + ".tasks.json" if self.ledger else None)
            # a server that forgets keeps its tasks in memory only, so a new process knows none
            self.store = TaskStore(None if forget else path, self.ledger, ttl_ms)

    @classmethod
    def from_env(cls, env=None):
        env = os.environ if env is None else env
        return cls(env.get("FAKE_PAYMENTS_LEDGER"), env.get("FAKE_PAYMENTS_DESCRIPTION"),
                   env.get("FAKE_PAYMENTS_TASKS"), env.get("FAKE_PAYMENTS_TASKS_FILE"),
                   int(env.get("FAKE_PAYMENTS_TASK_TTL_MS") or TASK_TTL_MS),
                   env.get("FAKE_PAYMENTS_TASKS_FORGET") == "1")

    def tools(self) -> list:
        tools = [
            {"name": "balance",
             "description": self.description if self.description is not None
             else "Reports the balance of an account.",
             "inputSchema": {"type": "object", "properties": {"account": {"type": "string"}},
                             "required": ["account"], "additionalProperties": False},
             "annotations": {"readOnlyHint": True}},
            {"name": "pay",
             "description": "Sends a payment to a recipient.",
             "inputSchema": {"type": "object",
                             "properties": {"to": {"type": "string"},
                                            "amount": {"type": "number"},
                                            "currency": {"type": "string"},
                                            "mode": {"type": "string", "enum": PAY_MODES +
                                                     ([INPUT_MODE] if self.tasks else [])}},
                             "required": ["to", "amount"], "additionalProperties": False},
             "annotations": {"destructiveHint": False}},
            {"name": "refund",
             "description": "Refunds a payment.",
             "inputSchema": {"type": "object", "properties": {"payment": {"type": "string"}},
                             "required": ["payment"], "additionalProperties": False}},
        ]
        for tool in tools:
            if self.tasks and tool["name"] in TASK_TOOLS:
                tool["execution"] = {"taskSupport": self.tasks}
        return tools

    def handle(self, method: str, params=None, era: str = "legacy", raw_args=None,
               cancelled=None) -> dict:
        """Answer one request in the given era: the result, or RPCError raised.
        ``raw_args`` are the received bytes of params.arguments (else they are re-encoded);
        ``cancelled`` is a threading.Event set when the request is cancelled."""
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise RPCError(INVALID_PARAMS, "params must be an object")
        cancelled = cancelled or threading.Event()
        if era == "modern":
            if method == "initialize":
                requested = params.get("protocolVersion")
                raise RPCError(UNSUPPORTED_VERSION,
                               f"connection is serving the {MODERN_VERSION} protocol",
                               {"supported": list(MODERN_VERSIONS),
                                "requested": requested if isinstance(requested, str) else ""})
            served = ("server/discover", "tools/list", "tools/call")
            if method not in served + (("tasks/get", "tasks/cancel") if self.tasks else ()):
                raise RPCError(METHOD_NOT_FOUND, f"method not found: {method}")
            check_modern_meta(params)
            if method == "server/discover":
                capabilities = {"tools": {}}
                if self.tasks:
                    capabilities["extensions"] = {TASKS_EXTENSION: {}}
                result = {"supportedVersions": list(MODERN_VERSIONS),
                          "capabilities": capabilities, "serverInfo": dict(SERVER_INFO),
                          "_meta": {META_SERVER: dict(SERVER_INFO)},
                          "ttlMs": 0, "cacheScope": "private"}
            elif method == "tools/list":
                result = {"tools": self.tools(), "ttlMs": 0, "cacheScope": "private"}
            elif method == "tools/call":
                result = self.tool_call(params, era, raw_args, cancelled)
            else:
                result = self.task_method(method, params, era, cancelled)
            result.setdefault("resultType", "complete")
            return result
        if method == "initialize":
            requested = params.get("protocolVersion")
            capabilities = {"tools": {}}
            if self.tasks:
                capabilities["tasks"] = {"cancel": {}, "requests": {"tools": {"call": {}}}}
            return {"protocolVersion": requested if requested in LEGACY_VERSIONS
                    else LEGACY_VERSIONS[-1],
                    "capabilities": capabilities, "serverInfo": dict(SERVER_INFO)}
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": self.tools()}
        if method == "tools/call":
            return self.tool_call(params, era, raw_args, cancelled)
        if self.tasks and method in ("tasks/get", "tasks/result", "tasks/cancel"):
            return self.task_method(method, params, era, cancelled)
        raise RPCError(METHOD_NOT_FOUND, f"method not found: {method}")

    # tasks mode: which calls become tasks, and the tasks/* methods

    def tool_call(self, params: dict, era: str, raw_args, cancelled) -> dict:
        """tools/call: a task when the tool supports one and the request asks for it."""
        if not self.tasks:
            return self.call(params, raw_args, cancelled)
        asks = params.get("task") is not None if era == "legacy" else declares_tasks(params)
        if params.get("name") not in TASK_TOOLS:
            if asks and era == "legacy":  # taskSupport absent means forbidden
                raise RPCError(METHOD_NOT_FOUND, f"{params.get('name')} does not run as a task")
            return self.call(params, raw_args, cancelled)
        if asks:
            return self.start_task(params, era, raw_args)
        if self.tasks == "required":
            if era == "legacy":
                raise RPCError(METHOD_NOT_FOUND, f"{params['name']} runs only as a task")
            raise RPCError(MISSING_CAPABILITY, f"{params['name']} runs only as a task",
                           {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}})
        args = params.get("arguments")
        if isinstance(args, dict) and args.get("mode") == INPUT_MODE:
            raise RPCError(INVALID_PARAMS, f"pay: mode {INPUT_MODE} runs only as a task")
        return self.call(params, raw_args, cancelled)

    def start_task(self, params: dict, era: str, raw_args) -> dict:
        """The task is on disk before its id is answered; its call runs in the background."""
        args = params.get("arguments")
        if params["name"] == "pay" and isinstance(args, dict) and args.get("mode") == INPUT_MODE:
            task = self.store.create(status="input_required", statusMessage="awaiting input",
                                     inputRequests=INPUT_REQUESTS)
        else:
            task = self.store.create()
            stop = self.store.stops[task["taskId"]] = threading.Event()
            threading.Thread(target=self.run_task, args=(task["taskId"], params, raw_args, stop),
                             daemon=True).start()
        if era == "legacy":
            return {"task": task_view(task, era)}
        return dict(task_view(task, era), resultType="task")

    def run_task(self, task_id: str, params: dict, raw_args, stop: threading.Event) -> None:
        def noted(result, mode, raw):
            if not self.store.change(task_id, intent=self.store.intent(result, mode, raw)):
                raise RPCError(CANCELLED, "task cancelled")  # before it paid: nothing is paid
        try:
            result = self.call(params, raw_args, stop, noted)
        except RPCError as e:
            self.store.change(task_id, status="failed", error=e.error(), statusMessage=e.message)
        except Exception as e:  # a failed task, not a dead thread
            message = f"internal error: {e}"
            self.store.change(task_id, status="failed", statusMessage=message,
                              error={"code": INTERNAL_ERROR, "message": message})
        else:
            self.store.change(task_id, status="completed", result=result)
        finally:
            self.store.stops.pop(task_id, None)

    def task_method(self, method: str, params: dict, era: str, cancelled) -> dict:
        if era == "modern" and not declares_tasks(params):
            raise RPCError(MISSING_CAPABILITY, f"{method} needs the {TASKS_EXTENSION} extension",
                           {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}})
        task_id = params.get("taskId")
        if method == "tasks/cancel":
            task, cancelled_now = self.store.cancel(task_id)
            if era == "modern":
                return {}
            if not cancelled_now:
                raise RPCError(INVALID_PARAMS, f"task {task_id} is already {task['status']}")
            return task_view(task, era)
        if method == "tasks/result":
            task = self.store.wait(task_id, cancelled)
            if task["status"] == "failed":
                error = task["error"]
                raise RPCError(error["code"], error["message"], error.get("data"))
            if task["status"] == "cancelled":
                raise RPCError(CANCELLED, "task cancelled")
            return dict(task["result"], _meta={META_RELATED_TASK: {"taskId": task_id}})
        task = self.store.look(task_id)
        view = task_view(task, era)
        if era == "modern":
            if task["status"] == "input_required":
                view["inputRequests"] = task["inputRequests"]
            elif task["status"] == "completed":
                view["result"] = dict(task["result"], resultType="complete")
            elif task["status"] == "failed":
                view["error"] = task["error"]
        return view

    # the tools

    def call(self, params: dict, raw_args=None, cancelled=None, noted=None) -> dict:
        """tools/call: dispatch on params.name. ``noted(result, mode, raw_args)``, when given,
        learns the answer just before the call does what cannot be undone."""
        name, args = params.get("name"), params.get("arguments")
        args = {} if args is None else args
        if not isinstance(args, dict):
            raise RPCError(INVALID_PARAMS, "arguments must be an object")
        if name == "balance":
            account = args.get("account")
            if not isinstance(account, str):
                raise RPCError(INVALID_PARAMS, "balance: account must be a string")
            return _text(f"account {account} holds 120.00 EUR")
        if name == "refund":
            if not isinstance(args.get("payment"), str):
                raise RPCError(INVALID_PARAMS, "refund: payment must be a string")
            result = _text("refunded")
            if noted is not None:
                noted(result, None, None)
            return result
        if name == "pay":
            if raw_args is None:
                raw_args = json.dumps(args, separators=(",", ":")).encode()
            return self.pay(args, raw_args, cancelled or threading.Event(), noted)
        raise RPCError(INVALID_PARAMS, f"unknown tool: {name}")

    def pay(self, args: dict, raw_args: bytes, cancelled: threading.Event, noted=None) -> dict:
        to, amount, mode = args.get("to"), args.get("amount"), args.get("mode")
        if not isinstance(to, str):
            raise RPCError(INVALID_PARAMS, "pay: to must be a string")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise RPCError(INVALID_PARAMS, "pay: amount must be a number")
        try:
            shown = "%.2f" % float(amount)
        except OverflowError:
            raise RPCError(INVALID_PARAMS, "pay: amount is out of range") from None
        if mode is not None and not isinstance(mode, str):
            raise RPCError(INVALID_PARAMS, "pay: mode must be a string")
        paid = f"paid {shown} to {to}"
        result = _text(paid)
        if mode == "error":
            result = _text(f"card declined for {to}", is_error=True)
        elif mode == "structured":
            result["structuredContent"] = {"paid": amount, "to": to}
        elif mode == "deep":
            nested = {"paid": amount}
            for _ in range(DEEP_LEVELS):
                nested = [nested]
            result = _text("deep")
            result["structuredContent"] = {"nested": nested}
        if noted is not None:
            noted(result, mode, raw_args)
        if self.ledger:
            try:
                self.record(raw_args)
            except OSError as e:
                raise RPCError(INTERNAL_ERROR, f"ledger: {e}") from None
        if mode == "slow":
            cancelled.wait(SLOW_SECONDS)
        elif mode == "block":
            release = self.ledger + ".release" if self.ledger else None
            while not (release and os.path.exists(release)):
                if cancelled.wait(POLL_SECONDS):
                    raise RPCError(CANCELLED, "request cancelled")
        return result

    def record(self, raw_args: bytes) -> None:
        """Append one ledger line, on disk before this returns."""
        with LEDGER_LOCK:
            fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                data = raw_args + b"\n"
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            finally:
                os.close(fd)


# --- stdio ------------------------------------------------------------------------------------

def _reject_constant(name):
    raise ValueError(f"not JSON: {name}")


def _request_key(request_id) -> str:
    return json.dumps(request_id, sort_keys=True)


class StdioServer:
    """One stdio connection: reads requests line by line, answers each as one line."""

    def __init__(self, server: FakePayments, out, era=None):
        self.server, self.out = server, out
        self.era = era if era in ("legacy", "modern") else None
        self.write_lock = threading.Lock()
        self.inflight = {}  # request key -> threading.Event
        self.inflight_lock = threading.Lock()  # guards inflight and threads
        self.threads = set()

    def send(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self.write_lock:
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, ValueError, OSError):
                os._exit(0)  # the client is gone

    def answer(self, request_id, fn) -> None:
        try:
            message = {"jsonrpc": "2.0", "id": request_id, "result": fn()}
        except RPCError as e:
            message = {"jsonrpc": "2.0", "id": request_id, "error": e.error()}
        except Exception as e:  # a bug here must not end the connection
            message = {"jsonrpc": "2.0", "id": request_id,
                       "error": {"code": INTERNAL_ERROR, "message": f"internal error: {e}"}}
        self.send(message)

    def serve(self, infile) -> None:
        for line in iter(infile.readline, b""):
            if line.strip():
                self.on_line(line)

    def on_line(self, line: bytes) -> None:
        try:
            msg = json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as e:
            self.send({"jsonrpc": "2.0", "id": None,
                       "error": {"code": PARSE_ERROR, "message": f"parse error: {e}"}})
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("method"), str):
            if isinstance(msg, dict) and "method" not in msg and ("result" in msg
                                                                  or "error" in msg):
                return  # a response from the client: this server sends no requests
            request_id = msg.get("id") if isinstance(msg, dict) else None
            self.send({"jsonrpc": "2.0", "id": request_id,
                       "error": {"code": INVALID_REQUEST, "message": "invalid request"}})
            return
        method, params = msg["method"], msg.get("params")
        if "id" not in msg:
            self.on_notification(method, params)
            return
        request_id = msg["id"]
        era = self.era
        if era is None:
            if method == "initialize":
                era = self.era = "legacy"
            elif method == "server/discover" or modern_version(params) is not None:
                try:
                    check_modern_meta(params)
                except RPCError as e:  # refused: the era stays open
                    self.send({"jsonrpc": "2.0", "id": request_id, "error": e.error()})
                    return
                era = self.era = "modern"
            else:
                era = "legacy"
        if method in ("tools/call", "tasks/result"):  # each may wait: in a thread of its own
            try:
                raw = raw_arguments(line)
            except (ValueError, IndexError):
                raw = None
            key, cancelled = _request_key(request_id), threading.Event()
            with self.inflight_lock:
                self.inflight[key] = cancelled

            def run():
                try:
                    self.answer(request_id,
                                lambda: self.server.handle(method, params, era, raw, cancelled))
                finally:
                    with self.inflight_lock:
                        if self.inflight.get(key) is cancelled:
                            del self.inflight[key]
                        self.threads.discard(threading.current_thread())

            thread = threading.Thread(target=run, daemon=True)
            with self.inflight_lock:
                self.threads.add(thread)
            thread.start()
        else:
            self.answer(request_id, lambda: self.server.handle(method, params, era))

    def on_notification(self, method: str, params) -> None:
        if method == "notifications/cancelled" and isinstance(params, dict):
            with self.inflight_lock:
                event = self.inflight.get(_request_key(params.get("requestId")))
            if event is not None:
                event.set()

    def close(self, deadline: float = 2.0) -> None:
        """Cancel every call still running and give them ``deadline`` seconds to answer."""
        with self.inflight_lock:
            calls = list(self.inflight.values())
        for cancelled in calls:
            cancelled.set()
        end = time.monotonic() + deadline
        with self.inflight_lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        self.write_lock.acquire(timeout=1)  # never exit in the middle of a line


def main() -> int:
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stdout carries protocol messages only
    conn = StdioServer(FakePayments.from_env(), out, os.environ.get("FAKE_PAYMENTS_ERA"))
    try:
        conn.serve(sys.stdin.buffer)
    except KeyboardInterrupt:
        pass
    conn.close()
    os._exit(0)  # threads still waiting (slow, block) end with the process


if __name__ == "__main__":
    sys.exit(main())

"""Tasks toward the host (section 23.1): a call the host waits on the protocol's way.

In-process (tests/proxy_harness.py), with the fake payment server behind the proxy.

- 2025-11-25: the capability and each tool's taskSupport are offered; every tools/call that
  carries params.task is answered a task, even an allowed read, which completes at once;
  tasks/result blocks until the call has an answer and carries the related-task _meta;
  tasks/cancel answers the task cancelled, and it stays so; an ended task cannot be
  cancelled; unknown ids are -32602.
- 2026-07-28: the extension is offered in server/discover; a declaring call that waits for an
  operator past `hold` is answered a task instead of PENDING_APPROVAL; tasks/get embeds the
  result; tasks/* without the declaration are -32021; tasks/result is not a method.
- The approval round trip as a task: the operator approves, the follower collects the
  recorded request once, and an identical call afterwards is not run again.
- A rejection completes the task with the rejection's isError text: never failed.
- A task outlives its proxy: the row is on disk before its id is given, a proxy started
  again answers for it and follows it, and collects once the operator decides.
- A host that does not declare tasks gets today's answers.
- Shutdown answers a waiting tasks/result at once, with an error that says so.
"""

import json

import pytest

from process_helpers import eventually, prefix, text
from proxy_harness import ProxyHarness, ap, limit_rules

META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "1"}}
DECLARED = {**META, "io.modelcontextprotocol/clientCapabilities": {
    "extensions": {"io.modelcontextprotocol/tasks": {}}}}
PAY = {"to": "bob", "amount": 25}


def initialized(h, version="2025-11-25"):
    """The legacy handshake, as a host that agrees on ``version`` makes it."""
    h.request("initialize", {"protocolVersion": version, "capabilities": {},
                             "clientInfo": {"name": "t", "version": "1"}})
    return h


@pytest.fixture
def h(tmp_path):
    harness = initialized(ProxyHarness(tmp_path))
    yield harness
    harness.close()


def legacy_task(h, name, args):
    """A 2025-11-25 tools/call that asks for a task: the task it is answered."""
    msg = h.request("tools/call", {"name": name, "arguments": args, "task": {"ttl": 60000}})
    assert "error" not in msg, msg
    return msg["result"]["task"]


def wait_for(h, predicate, timeout=20):
    """Run the proxy's loop until ``predicate`` holds (it may send requests itself)."""
    deadline = ap.time.monotonic() + timeout
    while not predicate():
        assert ap.time.monotonic() < deadline, "timed out"
        h.run(ap.asyncio.sleep(0.02))


def no_ids(text, h):
    """Nothing the model reads names a run, an approval, the database or the command."""
    for r in h.runs():
        assert r.id not in text
    for a in h.approvals():
        assert a.id not in text
    assert "runs.db" not in text and "agentrt" not in text.lower()


def test_a_legacy_host_is_offered_tasks(h):
    init = h.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                    "clientInfo": {"name": "t", "version": "1"}})["result"]
    tasks = init["capabilities"]["tasks"]
    assert tasks["requests"] == {"tools": {"call": {}}} and tasks["cancel"] == {}
    assert "list" not in tasks                      # an id is a bearer token
    tools = h.request("tools/list")["result"]["tools"]
    assert tools and all(t["execution"] == {"taskSupport": "optional"} for t in tools)


def test_a_legacy_task_of_an_allowed_read_completes_at_once(h):
    task = legacy_task(h, "bank_balance", {"account": "A-9"})
    assert set(task) >= {"taskId", "status", "createdAt", "lastUpdatedAt", "ttl",
                         "pollInterval"}
    assert task["status"] == "working"
    msg = h.request("tasks/result", {"taskId": task["taskId"]})
    result = msg["result"]
    assert h.text(result) == "account A-9 holds 120.00 EUR" and result["isError"] is False
    assert result["_meta"]["io.modelcontextprotocol/related-task"] == {
        "taskId": task["taskId"]}
    got = h.request("tasks/get", {"taskId": task["taskId"]})["result"]
    assert got["status"] == "completed" and "io.modelcontextprotocol/related-task" not in \
        json.dumps(got)
    # The id is random: not a run id, nor derived from one.
    run = h.runs()[-1]
    assert task["taskId"] != run.id and run.id.split(".")[-1] not in task["taskId"]
    assert len(task["taskId"]) >= 32


def test_proxy_approval_round_trip_as_a_legacy_task(h):
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    got = h.request("tasks/get", {"taskId": task["taskId"]})["result"]
    assert got["status"] == "working" and got["statusMessage"]
    no_ids(got["statusMessage"], h)
    assert h.payments() == 0
    h.decide(h.pending()[0], approve=True)
    result = h.request("tasks/result", {"taskId": task["taskId"]})["result"]
    assert result["isError"] is False and "paid 25.00 to bob" in h.text(result)
    assert h.payments() == 1
    assert h.request("tasks/get", {"taskId": task["taskId"]})["result"]["status"] == \
        "completed"
    # The identical call is not run again: the task collected the one execution.
    again = h.call("bank_pay", PAY)
    assert h.prefix(again) == "DUPLICATE" and h.payments() == 1


def test_a_rejected_task_completes_with_the_rejection(h):
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    h.decide(h.pending()[0], approve=False, note="not today")
    result = h.request("tasks/result", {"taskId": task["taskId"]})["result"]
    assert result["isError"] is True and h.prefix(result) == "REJECTED"
    assert h.request("tasks/get", {"taskId": task["taskId"]})["result"]["status"] == \
        "completed"
    assert h.payments() == 0


def test_a_legacy_task_cancelled_stays_cancelled(h):
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    got = h.request("tasks/cancel", {"taskId": task["taskId"]})["result"]
    assert got["status"] == "cancelled" and got["taskId"] == task["taskId"]
    again = h.request("tasks/cancel", {"taskId": task["taskId"]})
    assert again["error"]["code"] == -32602
    err = h.request("tasks/result", {"taskId": task["taskId"]})["error"]
    assert err["code"] == -32602 and "cancelled" in err["message"]
    assert h.request("tasks/get", {"taskId": task["taskId"]})["result"]["status"] == \
        "cancelled"
    assert h.payments() == 0


def test_a_host_cancel_withdraws_the_request_and_the_operator_sees_it(h):
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    approval = h.pending()[0]
    h.request("tasks/cancel", {"taskId": task["taskId"]})
    withdrawn = h.store.get_approval(approval.id)
    assert withdrawn.status == "cancelled" and withdrawn.decided_by == "host"
    run = h.store.get_run(approval.run_id)
    assert run.status == "CANCELLED" and run.reason == "host_withdrawn"
    assert ap.ended_why(h.store, run).startswith("withdrawn by the host")
    status = h.text(h.call("gate_status", {"approval_id": approval.id}))
    assert "WITHDRAWN" in status and "CANCELLED by the operator" not in status
    # Not an operator's decision: the identical call is a fresh request, asked again.
    again = h.call("bank_pay", PAY)
    assert h.prefix(again) == "PENDING_APPROVAL"
    assert [a.id for a in h.pending()] != [approval.id] and len(h.pending()) == 1
    assert h.payments() == 0


def test_a_host_cancel_leaves_an_interruption_approval_to_the_operator(tmp_path):
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "1s", "outcome": "allow"}}
    h = initialized(ProxyHarness(tmp_path, rules=rules))
    try:
        cut = {**PAY, "mode": "block"}
        assert h.prefix(h.call("bank_pay", cut)) == "UNKNOWN_OUTCOME"
        task = legacy_task(h, "bank_pay", cut)
        wait_for(h, lambda: len(h.pending()) == 1)
        approval = h.pending()[0]
        assert approval.kind == "interrupted_side_effect"
        got = h.request("tasks/cancel", {"taskId": task["taskId"]})["result"]
        assert got["status"] == "cancelled"
        assert h.store.get_approval(approval.id).status == "pending"
        assert h.store.get_run(approval.run_id).status == "WAITING_FOR_APPROVAL"
    finally:
        h.release()
        h.close()


def test_unknown_task_ids_are_refused(h):
    for method in ("tasks/get", "tasks/result", "tasks/cancel"):
        for params in ({"taskId": "nope"}, {"taskId": 7}, {}):
            assert h.request(method, params)["error"]["code"] == -32602
    # tasks/list is not offered
    assert h.request("tasks/list", {})["error"]["code"] == -32601


def test_a_modern_host_is_offered_the_tasks_extension(h):
    res = h.request("server/discover", {"_meta": META})["result"]
    assert res["capabilities"]["extensions"]["io.modelcontextprotocol/tasks"] == {}
    tools = h.request("tools/list", {"_meta": META})["result"]["tools"]
    assert all("execution" not in t for t in tools)


def test_proxy_approval_round_trip_as_a_modern_task(h):
    first = h.call("bank_pay", PAY, meta=DECLARED)
    assert first["resultType"] == "task" and first["status"] == "working"
    assert set(first) >= {"taskId", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs"}
    assert "content" not in first
    no_ids(first["statusMessage"], h)
    assert len(h.pending()) == 1 and h.payments() == 0
    h.decide(h.pending()[0], approve=True)

    def completed():
        got = h.request("tasks/get", {"taskId": first["taskId"], "_meta": DECLARED})
        return got["result"]["status"] == "completed"
    wait_for(h, completed)
    got = h.request("tasks/get", {"taskId": first["taskId"], "_meta": DECLARED})["result"]
    assert got["resultType"] == "complete"
    assert got["result"]["resultType"] == "complete" and got["result"]["isError"] is False
    assert "paid 25.00 to bob" in h.text(got["result"])
    assert h.payments() == 1


def test_modern_task_methods_need_the_declaration(h):
    first = h.call("bank_pay", PAY, meta=DECLARED)
    err = h.request("tasks/get", {"taskId": first["taskId"], "_meta": META})["error"]
    assert err["code"] == -32021
    assert err["data"]["requiredCapabilities"]["extensions"] == {
        "io.modelcontextprotocol/tasks": {}}
    assert h.request("tasks/result", {"taskId": first["taskId"],
                                      "_meta": DECLARED})["error"]["code"] == -32601
    assert h.request("tasks/get", {"taskId": "nope", "_meta": DECLARED})["error"]["code"] == \
        -32602
    ack = h.request("tasks/cancel", {"taskId": first["taskId"], "_meta": DECLARED})["result"]
    assert ack["resultType"] == "complete" and set(ack) <= {"resultType", "_meta"}
    got = h.request("tasks/get", {"taskId": first["taskId"], "_meta": DECLARED})["result"]
    assert got["status"] == "cancelled"


def test_a_host_that_declares_no_tasks_gets_todays_answers(h):
    legacy = h.call("bank_pay", PAY)
    assert h.prefix(legacy) == "PENDING_APPROVAL" and "task" not in legacy
    modern = h.call("bank_pay", {"to": "carol", "amount": 5}, meta=META)
    assert h.prefix(modern) == "PENDING_APPROVAL" and modern["resultType"] == "complete"
    # 2026-07-28 ignores params.task
    msg = h.request("tools/call", {"name": "bank_balance", "arguments": {"account": "A-9"},
                                   "task": {}, "_meta": META})["result"]
    assert msg["resultType"] == "complete" and "task" not in msg
    # an allowed read of a declaring host is answered at once, as today
    read = h.call("bank_balance", {"account": "A-9"}, meta=DECLARED)
    assert read["resultType"] == "complete" and read["isError"] is False


def test_a_task_outlives_its_proxy_and_the_next_one_collects(tmp_path):
    h = initialized(ProxyHarness(tmp_path))
    try:
        task = legacy_task(h, "bank_pay", PAY)
        wait_for(h, lambda: len(h.pending()) == 1)
        approval = h.pending()[0]
        h.run(h.host.shutdown())          # the proxy stops while its task waits
        assert not h.proxy.tasks.following
        h.proxy.close()                   # its holder file goes with it
        h.decide(approval, approve=True)  # decided while no proxy serves
        assert h.payments() == 0
        h.proxy = ap.Proxy(h.cfg, h.store, h.tools, h.log_lines.append, clock=h.clock,
                           poll=0.02)
        h.host = ap.HostServer(h.proxy, h.out.append)
        initialized(h)
        h.run(h.proxy.take_over_gone())   # as a proxy starting does
        assert task["taskId"] in h.proxy.tasks.following
        result = h.request("tasks/result", {"taskId": task["taskId"]})["result"]
        assert "paid 25.00 to bob" in h.text(result) and h.payments() == 1
    finally:
        h.close()


def test_a_task_of_a_live_proxy_is_not_taken_over(h):
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    other = ap.Tasks(h.proxy)
    other.follower = ";holder-" + "0" * 32 + ":1:1"    # a second proxy's view
    other.take_over_gone()
    assert not other.following
    row = h.proxy.tasks.get(task["taskId"])
    assert row.follower == h.proxy.tasks.follower


def test_shutdown_answers_a_waiting_task_result_at_once(h):
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    ident = h.request("tasks/result", {"taskId": task["taskId"]}, wait=False)
    h.run(h.host.shutdown(), timeout=10)
    err = h.answer(ident)["error"]
    assert "shutting down" in err["message"]
    assert h.payments() == 0


def test_the_task_row_is_on_disk_before_the_answer(h):
    task = legacy_task(h, "bank_balance", {"account": "A-9"})
    store = ap.Store.open(h.cfg.database)
    try:
        rows = store._read("SELECT task_id, tool FROM proxy_tasks")
    finally:
        store.close()
    assert (task["taskId"], "bank_balance") in rows


def test_a_modern_mutating_call_still_executing_after_hold_is_a_task(tmp_path):
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "20s", "outcome": "allow"}}
    h = initialized(ProxyHarness(tmp_path, rules=rules, hold="1s"))
    try:
        first = h.call("bank_pay", {**PAY, "mode": "block"}, meta=DECLARED)
        assert first["resultType"] == "task" and first["status"] == "working"
        wait_for(h, lambda: h.payments() == 1)      # it reached the server, which waits
        got = h.request("tasks/get", {"taskId": first["taskId"], "_meta": DECLARED})
        assert got["result"]["status"] == "working"
        h.release()

        def completed():
            got = h.request("tasks/get", {"taskId": first["taskId"], "_meta": DECLARED})
            return got["result"]["status"] == "completed"
        wait_for(h, completed)
        got = h.request("tasks/get", {"taskId": first["taskId"], "_meta": DECLARED})
        assert "paid 25.00 to bob" in h.text(got["result"]["result"])
        assert h.payments() == 1
        # a quick mutating call within hold is answered as today
        quick = h.call("bank_pay", {"to": "dan", "amount": 1}, meta=DECLARED)
        assert quick["resultType"] == "complete" and "paid 1.00 to dan" in h.text(quick)
    finally:
        h.close()


def test_the_status_tool_lists_the_hosts_open_tasks(h):
    assert "task" not in h.text(h.call("gate_status", {})).lower()
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    said = h.text(h.call("gate_status", {}))
    line = next(x for x in said.splitlines() if "working since" in x)
    assert "bank_pay" in line and "approval" in line
    assert task["taskId"] not in said          # an id is the host's to read the task with
    h.request("tasks/cancel", {"taskId": task["taskId"]})
    assert "working since" not in h.text(h.call("gate_status", {}))


def test_a_cancel_that_comes_before_the_call_began_withdraws_what_it_began(h):
    call = json.dumps({"jsonrpc": "2.0", "id": 900, "method": "tools/call", "params": {
        "name": "bank_pay", "arguments": PAY, "task": {}}}).encode()

    async def both():
        h.host.handle(call)               # answered at once, the follower scheduled
        while not any(json.loads(m).get("id") == 900 for m in h.out):
            await ap.asyncio.sleep(0)
        task = next(json.loads(m) for m in h.out if json.loads(m).get("id") == 900)
        task = task["result"]["task"]
        h.host.handle(json.dumps({"jsonrpc": "2.0", "id": 901, "method": "tasks/cancel",
                                  "params": {"taskId": task["taskId"]}}).encode())
        return task
    task = h.run(both())
    wait_for(h, lambda: not h.proxy.tasks.following)
    assert h.pending() == [] and h.payments() == 0
    assert all(r.status == "CANCELLED" and r.reason == "host_withdrawn" for r in h.runs())
    got = h.request("tasks/get", {"taskId": task["taskId"]})["result"]
    assert got["status"] == "cancelled"


@pytest.mark.parametrize("version", ["2025-06-18", "2025-03-26", "2024-11-05"])
def test_an_older_legacy_host_is_offered_no_tasks_and_gets_todays_answers(tmp_path, version):
    h = ProxyHarness(tmp_path)
    try:
        init = h.request("initialize", {"protocolVersion": version, "capabilities": {},
                                        "clientInfo": {"name": "t", "version": "1"}})
        assert "tasks" not in init["result"]["capabilities"]
        assert all("execution" not in t for t in h.request("tools/list")["result"]["tools"])
        msg = h.request("tools/call", {"name": "bank_pay", "arguments": PAY, "task": {}})
        assert "task" not in msg["result"] and h.prefix(msg["result"]) == "PENDING_APPROVAL"
    finally:
        h.close()


# ==== two proxies on one database, a host freezing its proxy, stale answers ===============

def second_proxy(h):
    """A second proxy on the same database and session, with a host of its own."""
    store = ap.Store.open(h.cfg.database)
    proxy = ap.Proxy(h.cfg, store, h.tools, h.log_lines.append, clock=h.clock, poll=0.02)
    out = []
    host = ap.HostServer(proxy, out.append)
    host.handle(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}).encode())
    return store, proxy, host, out


def ask(h, host, out, ident, method, params):
    async def go():
        host.handle(json.dumps({"jsonrpc": "2.0", "id": ident, "method": method,
                                "params": params}).encode())
        while True:
            for raw in out:
                msg = json.loads(raw)
                if msg.get("id") == ident:
                    return msg
            await ap.asyncio.sleep(0.01)
    return h.run(go(), 20)


def test_a_cancel_taken_by_another_proxy_stops_the_follower_and_nothing_begins_again(tmp_path):
    rules = limit_rules({"calls": 1, "per": "3s", "over": "require_approval"}, timeout="10s")
    h = initialized(ProxyHarness(tmp_path, rules=rules))
    store, proxy, host, out = second_proxy(h)
    try:
        assert "paid" in h.text(h.call("bank_pay", {"to": "x", "amount": 1}))
        task = legacy_task(h, "bank_pay", PAY)
        wait_for(h, lambda: len(h.pending()) == 1)
        h.run(ap.asyncio.sleep(3.5))          # the limit's window passes while it waits
        got = ask(h, host, out, 1, "tasks/cancel", {"taskId": task["taskId"]})
        assert got["result"]["status"] == "cancelled"
        wait_for(h, lambda: not h.proxy.tasks.following)
        assert h.payments() == 1               # the withdrawn request never ran
        assert len(h.approvals()) == 1 and h.approvals()[0].decided_by == "host"
    finally:
        h.run(host.shutdown())
        proxy.close()
        store.close()
        h.close()


def test_a_host_cannot_freeze_its_proxy_with_tasks(h):
    ids = [legacy_task(h, "bank_pay", PAY)["taskId"] for _ in range(ap.MAX_OPEN_TASKS)]
    over = h.request("tools/call", {"name": "bank_pay", "arguments": PAY, "task": {}})
    assert over["error"]["code"] == -32600 and "open" in over["error"]["message"]
    # the host's input is still read: a get, a ping, a cancel are answered
    assert h.request("ping")["result"] == {}
    assert h.request("tasks/get", {"taskId": ids[0]})["result"]["status"] == "working"
    h.request("tasks/cancel", {"taskId": ids[0]})
    assert "task" in h.request("tools/call", {"name": "bank_pay", "arguments": PAY,
                                              "task": {}})["result"]


def test_a_modern_request_the_host_cancelled_is_not_made_a_task(tmp_path):
    h = ProxyHarness(tmp_path, hold="2s")
    try:
        ident = h.request("tools/call", {"name": "bank_pay", "arguments": PAY,
                                         "_meta": DECLARED}, wait=False)
        wait_for(h, lambda: len(h.pending()) == 1)
        h.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                           "params": {"requestId": ident}}).encode())
        h.run(ap.asyncio.sleep(0.5))
        assert not any(json.loads(m).get("id") == ident for m in h.out)
        assert not h.proxy.tasks.following
        assert h.store._read("SELECT COUNT(*) FROM proxy_tasks") == [(0,)]
    finally:
        h.close()


def test_an_expired_approval_completes_its_task_with_the_expiry(h):
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    assert h.request("tasks/get", {"taskId": task["taskId"]})["result"]["ttl"] == \
        int((h.cfg.approval_ttl + ap.TASK_TTL_SLACK) * 1000)
    h.clock.skew += h.cfg.approval_ttl + 1          # the approval's time is over, not the task's
    result = h.request("tasks/result", {"taskId": task["taskId"]})["result"]
    assert h.prefix(result) == "EXPIRED" and h.is_error(result)
    run = h.runs()[-1]
    assert run.reason == "approval_expired"        # never "withdrawn by the host"
    assert h.payments() == 0


def test_a_task_past_its_ttl_is_gone(h):
    task = legacy_task(h, "bank_pay", PAY)
    wait_for(h, lambda: len(h.pending()) == 1)
    h.clock.skew += h.cfg.approval_ttl + ap.TASK_TTL_SLACK + 1
    for method in ("tasks/get", "tasks/result", "tasks/cancel"):
        assert h.request(method, {"taskId": task["taskId"]})["error"]["code"] == -32602
    assert "working since" not in h.text(h.call("gate_status", {}))
    wait_for(h, lambda: not h.proxy.tasks.following)
    h.proxy.tasks.take_over_gone()            # as a proxy starting does: forgotten
    assert h.store._read("SELECT COUNT(*) FROM proxy_tasks") == [(0,)]


def test_a_store_failure_is_not_a_tasks_answer(h):
    real = h.proxy.rules.decide
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 1:
            raise ap.StoreError("disk I/O error")
        return real(*args)
    h.proxy.rules.decide = failing
    task = legacy_task(h, "bank_balance", {"account": "A-9"})
    result = h.request("tasks/result", {"taskId": task["taskId"]})["result"]
    assert h.text(result) == "account A-9 holds 120.00 EUR" and len(calls) == 2


@pytest.mark.parametrize("modern", [False, True])
def test_a_task_whose_own_attempt_was_cut_off_completes_with_the_unknown_outcome(
        tmp_path, monkeypatch, modern):
    monkeypatch.setattr(ap, "TASK_HOLD", 0.5)      # the follower's hold before it looks
    rules = {"balance": {"side_effect": "read_only", "timeout": "10s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
    h = initialized(ProxyHarness(tmp_path, rules=rules, hold="1s"))
    try:
        cut = {**PAY, "mode": "block"}
        # 2026-07-28: the task is made once hold is over, the payment already inside
        task = h.call("bank_pay", cut, meta=DECLARED) if modern else \
            legacy_task(h, "bank_pay", cut)
        assert task["status"] == "working"
        wait_for(h, lambda: h.payments() == 1)   # inside the server, waiting
        # the proxy dies with it: its follower and its call are gone, its holder's lock
        # let go of (the file stays, as after a kill)
        for t, _ in list(h.proxy.tasks.following.values()):
            t.cancel()
        wait_for(h, lambda: not h.proxy.tasks.following)
        holder = h.proxy.holder
        ap._HELD.discard(holder.name)
        ap.os.close(holder.fd)
        holder.fd = -1
        h.proxy.close()
        h.proxy = ap.Proxy(h.cfg, h.store, h.tools, h.log_lines.append, clock=h.clock,
                           poll=0.02)
        h.host = ap.HostServer(h.proxy, h.out.append)
        initialized(h)
        h.run(h.proxy.take_over_gone())
        result = h.request("tasks/result", {"taskId": task["taskId"]})["result"]
        assert h.prefix(result) in ("INTERRUPTED", "UNKNOWN_OUTCOME")
        assert len(h.pending()) == 1 and h.pending()[0].kind == "interrupted_side_effect"
        # the question is another task's: the identical call made as a task waits on it
        second = legacy_task(h, "bank_pay", cut)
        h.run(ap.asyncio.sleep(0.3))
        assert h.request("tasks/get", {"taskId": second["taskId"]})["result"]["status"] == \
            "working"
        assert h.payments() == 1
    finally:
        h.release()
        h.close()


# ==== toward a server: a server that answers a call with a task ============================

ALLOW = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}


def tasked(tmp_path, era, mode="optional", rules=ALLOW, **top):
    """A proxy in front of the fake payment server in its tasks mode, of one era."""
    return ProxyHarness(tmp_path, rules=rules, server_env=[
        f"FAKE_PAYMENTS_TASKS={mode}", f"FAKE_PAYMENTS_ERA={era}"], **top)


def task_events(h):
    return [json.loads(p) for r in h.runs() for (_s, _r, _st, _a, typ, p, _h)
            in h.store.list_events(r.id) if typ == "step.tool_task"]


@pytest.mark.parametrize("era", ["legacy", "modern"])
@pytest.mark.parametrize("mode", ["optional", "required"])
def test_a_server_task_is_recorded_and_followed_to_its_answer(tmp_path, era, mode):
    h = tasked(tmp_path, era, mode)
    try:
        assert h.proxy.tools["bank_pay"].tasks
        result = h.call("bank_pay", PAY)
        assert h.text(result) == "paid 25.00 to bob" and not h.is_error(result)
        assert h.payments() == 1
        recorded = task_events(h)
        assert len(recorded) == 1 and recorded[0]["task_id"]
        step = h.store.list_steps(h.runs()[-1].id)[0]
        assert recorded[0]["started_at"] == step.started_at
        # a read the server does not run as a task is a plain call
        assert "holds" in h.text(h.call("bank_balance", {"account": "A-9"}))
        assert len(task_events(h)) == 1
    finally:
        h.close()


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_failed_server_task_is_a_known_failure(tmp_path, era):
    h = tasked(tmp_path, era)
    try:
        result = h.call("bank_pay", {**PAY, "mode": "error"})
        assert h.is_error(result) and h.prefix(result) != "UNKNOWN_OUTCOME"
        assert h.pending() == []                      # nothing to ask: it is known
        again = h.call("bank_pay", {**PAY, "mode": "error"})
        assert h.prefix(again) != "BLOCKED"
    finally:
        h.close()


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_server_task_that_asks_for_input_is_cancelled_and_its_outcome_unknown(tmp_path, era):
    h = tasked(tmp_path, era)
    try:
        result = h.call("bank_pay", {**PAY, "mode": "input"})
        assert h.prefix(result) == "UNKNOWN_OUTCOME"
        assert h.payments() == 0
        assert len(task_events(h)) == 1
    finally:
        h.close()


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_server_task_past_the_tools_timeout_is_an_unknown_outcome(tmp_path, era):
    rules = {**ALLOW, "pay": {**ALLOW["pay"], "timeout": "1s"}}
    h = tasked(tmp_path, era, rules=rules)
    try:
        result = h.call("bank_pay", {**PAY, "mode": "block"})
        assert h.prefix(result) == "UNKNOWN_OUTCOME" and h.payments() == 1
        assert len(task_events(h)) == 1              # what a take-over can ask about
    finally:
        h.release()
        h.close()


# ==== toward a server: a crash while the server runs the attempt as a task ==================

def crashed_inside_a_task(d, args):
    """A proxy killed while its payment is inside the server, as a task the proxy recorded:
    the run RUNNING under the dead proxy's lease. Returns the run id."""
    victim = d.start("victim")
    victim.send_call("bank_pay", args)
    eventually(lambda: d.payments() == 1, 15, "the payment to reach the server")
    run_id = [r for r in d.runs() if r["status"] == "RUNNING"][0]["id"]
    eventually(lambda: "step.tool_task" in d.event_types(run_id), 15, "the task to be recorded")
    victim.crash()
    return run_id


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_crash_during_a_task_is_learned_from_the_server_and_asks_nobody(tmp_path, procs,
                                                                          era):
    d = procs(tmp_path, allow_pay=True, lease_ttl="1h", server_env=[
        "FAKE_PAYMENTS_TASKS=optional", f"FAKE_PAYMENTS_ERA={era}"])
    args = {"to": "rob", "amount": 5, "mode": "block"}
    run_id = crashed_inside_a_task(d, args)
    d.release()                       # the server's task completes (it keeps its tasks)
    p = d.start("restarted")          # takes the dead proxy's run over as it starts
    eventually(lambda: d.show(run_id)["run"]["status"] == "COMPLETED", 15,
               "the run to end with what the server said")
    assert d.approvals() == []        # the server could say: the operator is asked nothing
    types = d.event_types(run_id)
    assert "step.tool_task_asked" in types and "approval.requested" not in types
    r = p.call("bank_pay", args)
    assert prefix(r) == "DUPLICATE" and "paid 5.00 to rob" in text(r), text(r)
    assert d.payments() == 1
    p.stop()


def test_a_server_that_cannot_say_leaves_the_question_to_the_operator(tmp_path, procs):
    d = procs(tmp_path, allow_pay=True, lease_ttl="1h", server_env=[
        "FAKE_PAYMENTS_TASKS=optional", "FAKE_PAYMENTS_ERA=modern",
        "FAKE_PAYMENTS_TASKS_FORGET=1"])     # its tasks are gone with its restart
    args = {"to": "rob", "amount": 5, "mode": "block"}
    run_id = crashed_inside_a_task(d, args)
    d.release()
    p = d.start("restarted")
    pending = eventually(d.pending, 15, "the operator to be asked")
    assert len(pending) == 1 and pending[0]["kind"] == "interrupted_side_effect", pending
    assert "step.tool_task_asked" in d.event_types(run_id)
    assert prefix(p.call("bank_pay", args)) == "INTERRUPTED"
    assert d.payments() == 1
    p.stop()


class CannedServer(ap.Upstream):
    """An upstream whose tasks/get and tasks/result answers are given."""

    def __init__(self, modern, answers):
        super().__init__("canned")
        self.modern, self.answers = modern, list(answers)

    async def request(self, method, params, timeout, tool="", tasks=False):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return ap.server_message(json.dumps({"jsonrpc": "2.0", "id": 1,
                                             "result": answer}).encode())


SINCE = "2026-01-01T00:00:00Z"
DONE = {"content": [{"type": "text", "text": "paid"}], "isError": False}


@pytest.mark.parametrize("modern", [False, True])
@pytest.mark.parametrize("told,learned", [
    ([ap.ProtocolError("unknown task", -32602)], None),              # unknown, or expired
    ([{"taskId": "t", "status": "working", "createdAt": "2026-01-02T00:00:00Z"}], "working"),
    ([{"taskId": "t", "status": "cancelled", "createdAt": "2026-01-02T00:00:00Z"}], None),
    ([{"taskId": "t", "status": "completed", "createdAt": "2026-01-03T00:00:00Z",  # reused id
       "result": DONE}, DONE], None),
    ([{"taskId": "u", "status": "completed", "createdAt": "2026-01-02T00:00:00Z",  # another
       "result": DONE}, DONE], None),
    ([{"taskId": "t", "status": "completed", "createdAt": "no time"}], None),
    ([{"taskId": "t", "status": "completed", "createdAt": "2026-01-02T00:00:00Z",
       "result": {**DONE, "resultType": "complete"}},
      {**DONE, "_meta": {"io.modelcontextprotocol/related-task": {"taskId": "t"}}}], "paid"),
])
def test_what_a_server_says_of_a_task_at_a_take_over(modern, told, learned):
    server = CannedServer(modern, told)
    found = ap.asyncio.run(server.ended_task("t", "2026-01-02T00:00:00Z", SINCE, 5))
    if learned in (None, "working"):
        assert found == (None if learned is None else ap.TASK_WORKING_STILL)
    else:
        assert found.doc["result"]["content"][0]["text"] == learned


def test_a_failed_task_at_a_take_over_is_its_error():
    server = CannedServer(True, [{"taskId": "t", "status": "failed", "createdAt":
                                  "2026-01-02T00:00:00Z", "error": {"code": -32603,
                                                                    "message": "broke"}}])
    found = ap.asyncio.run(server.ended_task("t", "2026-01-02T00:00:00Z", SINCE, 5))
    assert isinstance(found, ap.ProtocolError) and found.code == -32603


def test_a_legacy_result_that_names_no_task_or_another_says_nothing():
    told = {"taskId": "t", "status": "completed", "createdAt": "2026-01-02T00:00:00Z"}
    for meta in ({}, {"_meta": {"io.modelcontextprotocol/related-task": {"taskId": "u"}}}):
        server = CannedServer(False, [told, {**DONE, **meta}])
        assert ap.asyncio.run(server.ended_task("t", told["createdAt"], SINCE, 5)) is None


def test_an_answer_shaped_as_a_task_the_proxy_did_not_ask_for_is_no_answer():
    spec = ap.ToolSpec("bank_pay", "pays", b'{"type":"object"}', "remote_mutation", 5.0, True)
    tool = ap.UpstreamTool(spec, "bank", "pay", ap.Rule(side_effect="remote_mutation"), None)
    for result in ({"task": {"taskId": "t", "status": "working"}}, {"task": 7},
                   {"resultType": "task", "taskId": "t", "status": "working"}):
        msg = ap.server_message(json.dumps({"jsonrpc": "2.0", "id": 1,
                                            "result": result}).encode())
        with pytest.raises(ap.ToolFailure) as failed:
            ap.map_result(tool, msg)
        assert failed.value.ending == ap.NO_ANSWER
        obs = ap._observe("bank_pay", 5.0, failed.value)
        assert ap.unknown_ending(None, obs.doc) is not None   # an unknown outcome


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_server_that_dies_while_its_task_runs_leaves_the_outcome_unknown(tmp_path, era):
    h = tasked(tmp_path, era)
    try:
        ident = h.request("tools/call", {"name": "bank_pay", "arguments": {
            **PAY, "mode": "block"}}, wait=False)
        wait_for(h, lambda: h.payments() == 1 and task_events(h))
        ap.os.kill(h.proxy.tools["bank_pay"].conn.proc.pid, ap.signal.SIGKILL)
        result = h.answer(ident)["result"]
        assert h.prefix(result) == "UNKNOWN_OUTCOME", h.text(result)
    finally:
        h.close()


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_task_that_timed_out_is_settled_by_what_its_server_says(tmp_path, era):
    """At the timeout the server cannot say yet, so the operator is asked; the identical
    call later asks the server first, and what it says settles the question."""
    rules = {**ALLOW, "pay": {**ALLOW["pay"], "timeout": "1s"}}
    h = tasked(tmp_path, era, rules=rules)
    try:
        cut = {**PAY, "mode": "block"}
        assert h.prefix(h.call("bank_pay", cut)) == "UNKNOWN_OUTCOME"
        h.release()                       # the server's task ends: the payment went through
        h.run(ap.asyncio.sleep(0.5))
        assert len(h.pending()) == 1           # asked at the timeout
        again = h.call("bank_pay", cut)
        assert h.prefix(again) == "DUPLICATE" and "paid 25.00 to bob" in h.text(again)
        assert h.pending() == [] and h.payments() == 1
        assert [a.status for a in h.approvals()] == [ap.SETTLED_APPROVAL]
    finally:
        h.close()


def test_an_edited_task_answer_is_still_answered(h):
    task = legacy_task(h, "bank_balance", {"account": "A-9"})
    wait_for(h, lambda: h.proxy.tasks.get(task["taskId"]).answer is not None)
    with h.store.tx() as tx:
        tx.exec("UPDATE proxy_tasks SET answer='{not json' WHERE task_id=?", (task["taskId"],))
    assert h.request("tasks/result", {"taskId": task["taskId"]})["error"]["code"] == -32603

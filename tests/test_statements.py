"""An allowed call in few SQLite statements, recording exactly what it recorded before.

- A run a transaction moves is returned as a fresh read finds it, and a read of a run
  inside this thread's open transaction sees that transaction's writes.
- A new run's first step reads no steps (a run with no step counted has none).
- A run id already taken is refused and nothing is written.
- The call index's claim is a compare-and-set without a read: the open row the caller read
  is closed only while it is still open, and a key that has an open row takes no second one.
- The key's open row and its newest closed rows are one statement.
"""

import sqlite3

import pytest

from proxy_harness import ProxyHarness, ap
from test_rules_cost import InstantServer, instant_proxy

RULES = {"balance": {"side_effect": "read_only", "timeout": "10s"},
         "pay": {"side_effect": "remote_mutation", "timeout": "10s", "outcome": "allow"}}
PAY = "bank_pay"


@pytest.fixture
def h(tmp_path):
    harness = ProxyHarness(tmp_path, rules=RULES)
    yield harness
    harness.close()


def fresh_run(store: ap.Store, run_id: str) -> ap.Run:
    """The run as the table holds it, read past every cache."""
    row = store.conn.execute(f"SELECT {ap._RUN_COLS} FROM runs WHERE id=?",
                             (run_id,)).fetchone()
    return ap._run_from_row(row)


def fields(run: ap.Run) -> tuple:
    return tuple(getattr(run, f) for f in ap.Run.__dataclass_fields__)


def test_the_runs_a_transaction_knows_are_the_rows_a_fresh_read_finds(h):
    gate, store = h.proxy.gate, h.store
    decision = ap.Decision("tool_call", PAY, b'{"to":"bob","amount":1}')
    seen = []
    with store.tx():
        session = gate.begin("test.known", f"call {PAY}", h.proxy.limits)
        seen.append((store.get_run("test.known"), fresh_run(store, "test.known")))
        step = session.step()
        seen.append((store.get_run("test.known"), fresh_run(store, "test.known")))
        verdict = session.propose(decision)
        assert verdict.kind == "allowed"
        session.start()
        seen.append((store.get_run("test.known"), fresh_run(store, "test.known")))
        with store.tx() as tx:
            moved = tx.transition("test.known", (ap.RUNNING,), ap.WAITING)
            seen.append((moved, fresh_run(store, "test.known")))
            seen.append((tx.run("test.known"), fresh_run(store, "test.known")))
            moved = tx.transition("test.known", (ap.WAITING,), ap.RUNNING, owner=gate.owner,
                                  lease_until="2030-01-01T00:00:00.000000Z")
            seen.append((moved, fresh_run(store, "test.known")))
    assert step.idx == 0 and seen[1][1].step_count == 1
    for known, row in seen:
        assert fields(known) == fields(row)
    session.close()


def test_a_new_run_reads_no_steps_and_the_rules_read_the_index_once(tmp_path):
    h = ProxyHarness(tmp_path, rules=RULES)
    proxy = instant_proxy(h, InstantServer())
    statements: list[str] = []
    try:
        h.run(proxy.call("bank_balance", b'{"account":"A-0"}'))
        h.store.conn.set_trace_callback(statements.append)
        result = h.run(proxy.call("bank_balance", b'{"account":"A-1"}'))
        h.store.conn.set_trace_callback(None)
    finally:
        proxy.close()
        h.close()
    assert not result["isError"], result
    begin = statements.index("BEGIN IMMEDIATE")
    step_reads = [s for s in statements if s.startswith("SELECT") and " FROM steps " in s]
    index_reads = [s for s in statements if s.startswith("SELECT") and "proxy_calls" in s]
    assert step_reads == [], step_reads
    assert len(index_reads) == 1 and statements.index(index_reads[0]) < begin
    assert len(statements) <= 31, "\n".join(statements)   # 2 of them set the sync level


def test_a_run_id_already_taken_is_refused_and_nothing_is_written(h):
    gate = h.proxy.gate
    session = gate.begin("test.taken", "the first", h.proxy.limits)
    session.close()
    before = h.store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    other = ap.Gate(h.store, [ap.Tool(t.spec, t.call) for t in h.proxy.tools.values()],
                    h.proxy.policy, now=h.clock, lease_owner="another")
    try:
        with pytest.raises(ap.RunStateError, match="already exists"):
            other.begin("test.taken", "the second", h.proxy.limits)
    finally:
        other.close()
    assert fresh_run(h.store, "test.taken").goal == "the first"
    assert h.store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == before


def index_rows(h) -> list[tuple]:
    return h.store.conn.execute("SELECT id, request_key, run_id, open FROM proxy_calls "
                                "ORDER BY id").fetchall()


def test_a_claim_over_an_open_row_it_did_not_read_writes_nothing(h):
    index, now = h.proxy.index, h.clock()
    index.claim("key", PAY, "remote_mutation", "test.one", None, now)
    before = index_rows(h)
    with pytest.raises(ap.IndexRace):
        index.claim("key", PAY, "remote_mutation", "test.two", None, now)     # read none
    assert index_rows(h) == before
    first = index.open_row("key")
    index.claim("key", PAY, "remote_mutation", "test.three", first, now)
    after = index_rows(h)
    with pytest.raises(ap.IndexRace):                                           # closed since
        index.claim("key", PAY, "remote_mutation", "test.four", first, now)
    assert index_rows(h) == after
    assert [r[2:] for r in after] == [("test.one", 0), ("test.three", 1)]


def test_a_claim_under_a_run_id_in_use_is_an_error_not_a_race(h):
    index, now = h.proxy.index, h.clock()
    index.claim("key", PAY, "remote_mutation", "test.one", None, now)
    with pytest.raises(ap.StoreError):
        index.claim("other key", PAY, "remote_mutation", "test.one", None, now)
    assert [r[1:] for r in index_rows(h)] == [("key", "test.one", 1)]


def test_the_keys_rows_are_its_open_row_and_its_newest_closed_rows(h):
    index = h.proxy.index
    prev = None
    for i in range(12):
        index.claim("key", PAY, "remote_mutation", f"test.{i}", prev, 100.0 + i)
        index.claim(f"noise {i}", PAY, "remote_mutation", f"test.noise.{i}", None, 100.0 + i)
        prev = index.open_row("key")
    open_row, rows = index.for_key("key", 0.0)
    assert open_row.run_id == "test.11" and open_row.open == 1
    assert [r.run_id for r in rows] == ["test.11"] + [f"test.{i}" for i in
                                                      range(10, 10 - ap.RULE_ROWS, -1)]
    open_row, rows = index.for_key("key", 108.0)       # closed at 108 or later: 7 to 10
    assert [r.run_id for r in rows] == ["test.11", "test.10", "test.9", "test.8", "test.7"]
    assert index.for_key("no such key", 0.0) == (None, [])


def test_a_closed_rows_only_key_has_no_open_row(h):
    index = h.proxy.index
    index.claim("key", PAY, "remote_mutation", "test.a", None, 1.0)
    with h.store.tx() as tx:
        tx.exec("UPDATE proxy_calls SET open=0, closed_at=2.0 WHERE run_id='test.a'")
    open_row, rows = index.for_key("key", 0.0)
    assert open_row is None and [r.run_id for r in rows] == ["test.a"]
    with pytest.raises(sqlite3.IntegrityError):       # the index the claim relies on
        h.store.conn.execute("INSERT INTO proxy_calls (session, request_key, tool, "
                             "side_effect, run_id, created_at) VALUES ('s','k','t','r','x',0), "
                             "('s','k','t','r','y',0)")


# -- a frame's spans, recorded while it is parsed --

FRAMES = [
    b'{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{"name":"t","arguments":{"a":1}}}',
    b' { "id" : "x\\u00e9" , "params" : { "name" : "t" ,\t"arguments" : { } } , "z" : [1, {"b": 2}] } ',
    b'{"id":-1.5e3,"result":{"content":[{"type":"text","text":"a\\"b"}],"isError":false},"x":null}',
    b'{"a":true,"b":false,"c":null,"d":"","e":{},"f":[],"g":{"h":{"i":{"j":1}}}}',
    b'{"k\\u0041":{"in":"\\ud83d\\ude00"},"kA":{"in":2},"params":[1,2]}',      # a repeated key
    b'{"params":{"arguments":"\xff\xfe not UTF-8","name":"n"},"id":1}',
    b'{"a":{"b":1},"a":5,"c":{"d":{"e":2}}}',                                # a dict dropped
    b'{"id":0,"result":{"x":"\\n\\t","y":12345678901234567890,"z":[{"q":"}"}]}}',
    b'{}',
]


@pytest.mark.parametrize("frame", FRAMES, ids=range(len(FRAMES)))
def test_a_frames_spans_are_found_while_it_is_parsed(frame):
    msg = ap.parse_message(frame)
    members = [(msg.spans, msg.doc)]
    members += [(msg.inner[name], msg.doc[name]) for name in msg.inner]
    for name, (a, _) in msg.spans.items():
        assert (name in msg.inner) == (msg.text[a] == "{"), name
    params = msg.doc.get("params")
    assert msg.params_spans == (msg.inner["params"] if isinstance(params, dict) else {})
    if b"\xff" in frame:
        return                                     # its arguments are not JSON text alone
    for spans, doc in members:                     # each span is its value, exactly
        assert set(spans) == set(doc)
        for name, (a, b) in spans.items():
            value = ap.parse_json(msg.text[a:b].encode(), strict=False, bounds=False)
            assert ap.encode_canonical(value) == ap.encode_canonical(doc[name])


RECORDS = [
    b'{"kind":"tool_call","tool":"bank_pay","args":{"to":"bob","amount":1.50},"origin":"model"}',
    b'{"kind":"tool_call","tool":"t","args":{"a":{"b":[1,{"c":"\\u00e9\\n"}]},"z":1e400},'
    b'"origin":"model"}',
    b'{"kind":"complete","result":"done","args":{}}',
    b'{"kind":"fail","message":"x"}',
    b' { "kind" : "tool_call" , "args" : [ 1 , 2 ] } ',
]


@pytest.mark.parametrize("raw", RECORDS, ids=range(len(RECORDS)))
def test_a_records_members_come_from_the_one_parse_that_reads_it(raw):
    doc, members = ap.read_members(raw)
    assert ap.encode_canonical(doc) == ap.encode_canonical(ap.read_own(raw))
    for name, member in members.items():                       # each its value's bytes
        assert ap.read_own(member) == doc[name]
    row = ("step", "run", 0, "done", raw.decode(), "", "", "", "", "", "", "")
    step = ap._step_from_row(row)
    assert step.decision == ap.loads_own(raw)
    assert step.args == members.get("args", b"")


def test_a_record_that_is_not_an_object_is_unreadable():
    with pytest.raises(ap.JSONError, match="expected an object"):
        ap.read_members(b'["kind"]')
    row = ("step", "run", 0, "done", '["kind"]', "", "", "", "", "", "", "")
    with pytest.raises(ap.StoreError, match="cannot be read"):
        ap._step_from_row(row)

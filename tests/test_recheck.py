"""recheck: today's configuration's policy handed every decision the proxy's policy recorded,
run by run, read-only.

Specification: proxy-seed.md "Re-checking recorded calls"; DESIGN.md 2 (exit codes: recheck as
the seed says); reference/proxy.md 12.5 (the command), 13 (PolicyID, Recheck, recordedRerun),
16.4 (the text writer); test rows 48, 50, 51, 61 and 62 of reference/proxy.md 17.2.
"""

import io
import json
import os
import re
import sqlite3
import subprocess
import sys
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import agentrt_proxy as ap  # noqa: E402
from proxy_harness import DEFAULT_RULES, ProxyHarness  # noqa: E402

SCRIPT = os.path.join(ROOT, "agentrt_proxy.py")
FAKE_SERVER = os.path.join(ROOT, "fake_payment_server.py")
ID_RE = r"agentrt-proxy/sha256:[0-9a-f]{64}"
CALL_TIMEOUT = 20
DENY_PAY = ("bank_pay: require_approval -> deny: side effect remote_mutation is deny by "
            "policy")


# ---- helpers ----

def recheck(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["recheck", *args], stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def recheck_json(*args: str) -> tuple[int, list, str]:
    code, out, err = recheck(*args, "-json")
    return code, json.loads(out), err


def variant(config_path: str, name: str, change) -> str:
    """A copy of the configuration beside it (so relative paths name the same files), changed."""
    with open(config_path) as f:
        doc = json.load(f)
    change(doc)
    path = os.path.join(os.path.dirname(config_path), name)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    os.chmod(path, 0o600)
    return path


def rule(doc, tool):
    return doc["servers"][0]["rules"][tool]


def summary(out: str) -> str:
    lines = out.rstrip("\n").split("\n")
    assert len(lines) >= 2, out
    return lines[-2]


def scope(out: str) -> str:
    return out.rstrip("\n").split("\n")[-1]


def evals(report: dict) -> list[tuple]:
    return [(e["tool"], e["result"], e["recorded"], e["rechecked"])
            for e in report["evaluations"]]


def snapshot(path: str) -> tuple:
    st = os.stat(path)
    with open(path, "rb") as f:
        return f.read(), st.st_mtime_ns, st.st_size, st.st_mode


def check_counts(line: str, runs: int, decisions: int, skipped: int, differ: int) -> None:
    assert re.search(rf"\b{runs} run\(s\) re-checked under {ID_RE}", line), line
    assert re.search(rf"\b{decisions} decision\(s\) re-checked", line), line
    assert re.search(rf"\b{skipped} not re-checkable and skipped", line), line
    assert re.search(rf"\b{differ} run\(s\) differ", line), line


# ---- recorded runs: a read, a payment approved and collected, a refund denied ----

@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recorded")
    h = ProxyHarness(tmp)
    try:
        r = h.call("bank_balance", {"account": "A-1"}, timeout=CALL_TIMEOUT)
        assert "account A-1 holds" in h.text(r)
        pay = {"to": "bob", "amount": 25}
        assert h.prefix(h.call("bank_pay", pay, timeout=CALL_TIMEOUT)) == "PENDING_APPROVAL"
        [approval] = h.pending()
        h.decide(approval)
        assert "paid 25.00 to bob" in h.text(h.call("bank_pay", pay, timeout=CALL_TIMEOUT))
        r = h.call("bank_refund", {"payment": "p-1"}, timeout=CALL_TIMEOUT)
        assert h.prefix(r) == "DENIED"
        runs = [run.id for run in h.runs()]
        assert len(runs) == 3
        config, database = h.config_path, h.cfg.database
    finally:
        h.close()
    # Another session in the same database.
    (tmp / "other").mkdir()
    other = ProxyHarness(tmp / "other", database=database, session="other")
    try:
        r = other.call("bank_balance", {"account": "B-2"}, timeout=CALL_TIMEOUT)
        assert "account B-2 holds" in other.text(r)
        other_runs = [run.id for run in other.runs() if run.id.startswith("other.")]
    finally:
        other.close()
    assert len(other_runs) == 1
    return types.SimpleNamespace(
        dir=str(tmp), config=config, db=database, balance=runs[0], pay=runs[1],
        refund=runs[2], other=other_runs[0],
        deny=variant(config, "deny.json",
                     lambda d: d.update(policy={"remote_mutation": "deny"})),
        reworded=variant(config, "reworded.json",
                         lambda d: rule(d, "pay").update(
                             description="Sends money to someone; it cannot be undone.")))


# ---- row 48 ----

def test_recheck_changed_policy_names_the_calls_now_denied(rec):
    cfg = ap.load_config(rec.config)
    code, reps, err = recheck_json("-config", rec.config)
    assert code == 0, err
    assert [r["run_id"] for r in reps] == [rec.refund, rec.pay, rec.balance]   # newest first
    assert evals(reps[0]) == [("bank_refund", "same", "deny", "deny")]
    assert evals(reps[1]) == [("bank_pay", "same", "require_approval", "require_approval")] * 2
    assert [e["on_resume"] for e in reps[1]["evaluations"]] == [False, True]
    assert evals(reps[2]) == [("bank_balance", "same", "allow", "allow")]
    assert [r["run_status"] for r in reps] == ["FAILED", "COMPLETED", "COMPLETED"]
    for r in reps:
        assert r["same"] is True and r["identity"] == "unchanged"
        assert r["policy_id"] == cfg.policy_id() and re.fullmatch(ID_RE, r["policy_id"])
        assert r["spec_source"] == "recorded"
        # Every decision recorded the identity of the policy that made it.
        assert all(e["policy_id"] == cfg.policy_id() for e in r["evaluations"])

    denied = ap.load_config(rec.deny).policy_id()
    assert denied != cfg.policy_id() and re.fullmatch(ID_RE, denied)
    code, reps, err = recheck_json("-config", rec.deny)
    assert code == 1
    assert [r["run_id"] for r in reps] == [rec.refund, rec.pay, rec.balance]
    assert evals(reps[1]) == [("bank_pay", "different", "require_approval", "deny")] * 2
    assert reps[1]["same"] is False and reps[1]["identity"] == "changed"
    assert all(r["policy_id"] == denied for r in reps)
    assert all(e["policy_id"] == cfg.policy_id() for e in reps[1]["evaluations"])
    assert evals(reps[0]) == [("bank_refund", "same", "deny", "deny")] and reps[0]["same"]
    assert evals(reps[2]) == [("bank_balance", "same", "allow", "allow")] and reps[2]["same"]

    code, reps, err = recheck_json("-config", rec.deny, "-run", rec.pay)
    assert code == 1 and [r["run_id"] for r in reps] == [rec.pay]
    code, reps, err = recheck_json("-config", rec.config, "-run", rec.balance)
    assert code == 0 and [r["run_id"] for r in reps] == [rec.balance]

    code, reps, err = recheck_json("-config", rec.config, "-limit", "2")
    assert code == 0 and [r["run_id"] for r in reps] == [rec.refund, rec.pay]
    code, reps, err = recheck_json("-config", rec.config, "-limit", "1")
    assert code == 0 and [r["run_id"] for r in reps] == [rec.refund]

    # -session names another session of the same database; the configuration's is the default.
    code, reps, err = recheck_json("-config", rec.config, "-session", "other")
    assert code == 0, err
    assert [r["run_id"] for r in reps] == [rec.other]
    assert evals(reps[0]) == [("bank_balance", "same", "allow", "allow")]
    code, reps, err = recheck_json("-config", rec.config, "-session", "nobody")
    assert (code, reps) == (1, [])
    assert "error" not in err and '"nobody"' in err


# ---- row 50 ----

def test_recheck_current_tools_after_a_description_change(rec):
    assert ap.load_config(rec.reworded).policy_id() == ap.load_config(rec.config).policy_id()
    code, reps, err = recheck_json("-config", rec.reworded)
    assert code == 0, err
    assert all(r["same"] and r["spec_source"] == "recorded" for r in reps)

    code, reps, err = recheck_json("-config", rec.reworded, "-current-tools")
    assert code == 1, err
    assert [r["run_id"] for r in reps] == [rec.refund, rec.pay, rec.balance]
    pay = reps[1]
    assert pay["spec_source"] == "current" and pay["identity"] == "unchanged"
    assert evals(pay) == [("bank_pay", "different", "require_approval", "require_approval")] * 2
    for e in pay["evaluations"]:
        assert "tool spec" in e["detail"]
        assert e["recorded_hash"] and e["rechecked_hash"] and \
            e["recorded_hash"] != e["rechecked_hash"]
    assert reps[0]["same"] and reps[2]["same"]
    assert all(r["spec_source"] == "current" for r in reps)
    assert "registered pay as bank_pay" in err
    assert all(line.startswith("agentrt-proxy: ") for line in err.splitlines())

    # The configuration as it was recorded re-checks the same with the current tools too.
    code, reps, err = recheck_json("-config", rec.config, "-current-tools")
    assert code == 0, err
    assert all(r["same"] for r in reps)


def test_recheck_covers_the_gates_policy_and_only_it(rec):
    """The policy map, each rule's outcome, its fixed values and its rename are covered;
    without -current-tools a description or denied parameters are not."""
    def pay_results(path, *extra):
        code, reps, err = recheck_json("-config", path, *extra)
        [pay] = [r for r in reps if r["run_id"] == rec.pay]
        others = [r["same"] for r in reps if r["run_id"] != rec.pay]
        return code, [(e["result"], e["recorded"], e["rechecked"])
                      for e in pay["evaluations"]], others

    for name, change, now in (
            ("fixed", dict(fixed={"currency": "EUR"}), "require_approval"),
            ("rename", dict(rename="send_money"), "deny"),
            ("outcome", dict(outcome="allow"), "allow"),
            ("class", dict(side_effect="destructive"), "deny")):
        path = variant(rec.config, f"cover-{name}.json",
                       lambda d, c=change: rule(d, "pay").update(c))
        assert ap.load_config(path).policy_id() != ap.load_config(rec.config).policy_id()
        code, results, others = pay_results(path)
        assert code == 1, name
        assert results == [("different", "require_approval", now)] * 2, name
        assert others == [True, True], name

    for name, change in (("deny", dict(deny=["currency"])),
                         ("timeout", dict(timeout="20s")),
                         ("description", dict(description="Moves money."))):
        path = variant(rec.config, f"cover-{name}.json",
                       lambda d, c=change: rule(d, "pay").update(c))
        code, results, others = pay_results(path)
        assert code == 0, name
        assert results == [("same", "require_approval", "require_approval")] * 2, name
    # With the tools as loaded now, a denied parameter changes the schema the approval binds.
    code, results, others = pay_results(os.path.join(rec.dir, "cover-deny.json"),
                                        "-current-tools")
    assert code == 1
    assert results == [("different", "require_approval", "require_approval")] * 2


def test_recheck_connects_to_no_server_without_current_tools(rec):
    """Without -current-tools nothing is started; with it, the reach check and the pin apply."""
    absent = variant(rec.config, "absent-server.json", lambda d: d["servers"][0].update(
        command=[os.path.join(rec.dir, "no-such-server")]))
    code, out, err = recheck("-config", absent)
    assert code == 0, err
    code, out, err = recheck("-config", absent, "-current-tools")
    assert code == 1 and "error" in err

    reaching = variant(rec.config, "reaching.json", lambda d: d["servers"][0].update(
        command=[sys.executable, FAKE_SERVER, rec.dir]))
    code, out, err = recheck("-config", reaching)
    assert code == 0, err
    code, out, err = recheck("-config", reaching, "-current-tools")
    assert code == 1 and "skip_path_check" in err, err


# ---- row 51 ----

def test_recheck_re_run_of_an_unknown_outcome_is_the_same(tmp_path):
    rules = dict(DEFAULT_RULES)
    rules["pay"] = {"side_effect": "remote_mutation", "timeout": "300ms", "outcome": "allow"}
    h = ProxyHarness(tmp_path, rules=rules)
    try:
        args = {"to": "kim", "amount": 7, "mode": "block"}
        r = h.call("bank_pay", args, timeout=CALL_TIMEOUT)
        assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
        [approval] = h.pending()
        assert approval.kind == "interrupted_side_effect"
        h.release()
        h.decide(approval)
        r = h.call("bank_pay", args, timeout=CALL_TIMEOUT)
        assert "paid 7.00 to kim" in h.text(r)
        assert h.payments() == 2
        [run] = h.runs()
        approval = h.store.get_approval(approval.id)
    finally:
        h.close()

    code, reps, err = recheck_json("-config", h.config_path)
    assert code == 0, err
    [rep] = reps
    assert rep["run_id"] == run.id and rep["same"] and rep["identity"] == "unchanged"
    assert evals(rep) == [("bank_pay", "same", "allow", "allow"),
                          ("bank_pay", "same", "require_approval", "require_approval"),
                          ("bank_pay", "same", "require_approval", "require_approval")]
    assert [e["on_resume"] for e in rep["evaluations"]] == [False, False, True]
    # The re-run asked for an interruption approval then and is handed the same question now:
    # the hash binds the kind, the capability naming the earlier attempt, and the request.
    conn = sqlite3.connect(f"file:{h.cfg.database}?mode=ro", uri=True)
    try:
        kinds = {seq: json.loads(p).get("kind") for seq, p in conn.execute(
            "SELECT seq, payload_json FROM events WHERE type='step.policy'")}
    finally:
        conn.close()
    for e in rep["evaluations"][1:]:
        assert kinds[e["seq"]] == "interrupted_side_effect"
        assert e["recorded_hash"] == e["rechecked_hash"] == approval.hash

    code, out, err = recheck("-config", h.config_path)
    assert code == 0, err
    assert re.search(r"^same      step 0 seq \d+ bank_pay: allow$", out, re.M), out
    assert len(re.findall(r"^same      step 1 seq \d+ bank_pay( \(on resume\))?: "
                          r"require_approval$", out, re.M)) == 2, out
    check_counts(summary(out), 1, 3, 0, 0)

    # A rule that now denies pay: the first call and the re-run are both denied now.
    denied = variant(h.config_path, "deny.json", lambda d: rule(d, "pay").update(outcome="deny"))
    code, reps, err = recheck_json("-config", denied)
    assert code == 1
    assert [(e["result"], e["recorded"], e["rechecked"]) for e in reps[0]["evaluations"]] == [
        ("different", "allow", "deny"), ("different", "require_approval", "deny"),
        ("different", "require_approval", "deny")]
    # A rule that asks for approval: the re-run is still the interruption question, the same.
    asks = variant(h.config_path, "asks.json",
                   lambda d: rule(d, "pay").update(outcome="require_approval"))
    code, reps, err = recheck_json("-config", asks)
    assert code == 1
    assert [(e["result"], e["recorded"], e["rechecked"]) for e in reps[0]["evaluations"]] == [
        ("different", "allow", "require_approval"),
        ("same", "require_approval", "require_approval"),
        ("same", "require_approval", "require_approval")]


# ---- row 61 ----

SCOPE_PHRASES = ["policy map", "outcome", "fixed", "rename", "duplicate", "repeat window",
                 "max_pending", "rejected", "expired", "before the gate", "-current-tools",
                 "schema", "denied parameters"]


def test_cli_recheck(rec):
    code, out, err = recheck("-config", rec.config)
    assert code == 0, err
    check_counts(summary(out), 3, 4, 0, 0)
    assert summary(out).startswith("3 run(s) re-checked under " + ap.load_config(
        rec.config).policy_id())
    for phrase in SCOPE_PHRASES:
        assert phrase in scope(out), phrase
    assert "DIFFERENT" not in out
    assert "policy unchanged" in out and "policy changed" not in out
    assert "same      step 0 seq " in out
    assert "bank_balance: allow" in out and "bank_refund: deny" in out
    assert "bank_pay (on resume): require_approval" in out
    for run_id in (rec.balance, rec.pay, rec.refund):
        assert run_id in out
    assert rec.other not in out
    # Runs come newest first, each followed by a blank line.
    assert out.index(rec.refund) < out.index(rec.pay) < out.index(rec.balance)
    assert err == ""

    code, out, err = recheck("-config", rec.deny)
    assert code == 1
    assert len(re.findall(r"^DIFFERENT ", out, re.M)) == 2
    assert DENY_PAY in out
    assert "bank_pay (on resume): require_approval -> deny" in out
    assert "policy changed" in out
    check_counts(summary(out), 3, 4, 0, 1)
    # The differing evaluations of a run come first.
    pay_block = out[out.index(rec.pay):].split("\n\n")[0].split("\n")
    assert pay_block[1].startswith("DIFFERENT") and pay_block[2].startswith("DIFFERENT")

    code, out, err = recheck("-config", rec.reworded)
    assert code == 0, err
    check_counts(summary(out), 3, 4, 0, 0)

    code, reps, err = recheck_json("-config", rec.reworded, "-current-tools")
    assert code == 1
    assert len(reps) == 3
    assert reps[1]["spec_source"] == "current" and reps[1]["identity"] == "unchanged"
    assert len(reps[1]["evaluations"]) == 2
    assert reps[1]["evaluations"][0]["result"] == "different"
    assert "tool spec" in reps[1]["evaluations"][0]["detail"]
    assert reps[0]["same"]
    assert "registered pay as bank_pay" in err

    code, out, err = recheck("-config", rec.config, "-run", rec.balance)
    assert code == 0, err
    check_counts(summary(out), 1, 1, 0, 0)
    assert "bank_balance: allow" in out and rec.pay not in out

    code, out, err = recheck("-config", rec.config, "-run", "nope")
    assert code == 1 and "not found" in err

    # Two dashes are accepted too, and -flag=value.
    code, out, err = recheck("--config", rec.config, "--run", rec.balance, "--json")
    assert code == 0 and [r["run_id"] for r in json.loads(out)] == [rec.balance]
    code, out, err = recheck(f"-config={rec.config}", f"-run={rec.balance}")
    assert code == 0, err


@pytest.mark.parametrize("argv", [
    pytest.param(["-config", "{cfg}", "-run", "x", "-session", "y"], id="run and session"),
    pytest.param(["-config", "{cfg}", "-limit", "0"], id="limit 0"),
    pytest.param(["-config", "{cfg}", "-limit", "-3"], id="limit negative"),
    pytest.param(["-config", "{cfg}", "-limit", "two"], id="limit not a number"),
    pytest.param([], id="no config"),
    pytest.param(["-run", "x"], id="no config with run"),
    pytest.param(["-config", "{cfg}", "extra"], id="an extra argument"),
    pytest.param(["-config", "{cfg}", "-nope"], id="an unknown flag"),
    pytest.param(["-config"], id="config without a value"),
])
def test_cli_recheck_usage_errors_exit_2(rec, tmp_path, argv):
    for cfg in (rec.config, str(tmp_path / "absent.json")):   # judged before anything is read
        before = snapshot(rec.db)
        code, out, err = recheck(*[a.replace("{cfg}", cfg) for a in argv])
        assert code == 2, (argv, err)
        assert out == ""
        assert err.startswith("agentrt-proxy: ") and "usage" in err.lower()
        assert snapshot(rec.db) == before


def test_cli_recheck_errors_exit_1(rec, tmp_path):
    # A configuration that does not load.
    code, out, err = recheck("-config", str(tmp_path / "absent.json"))
    assert code == 1 and "agentrt-proxy: error: " in err
    # A database that does not exist is not created.
    missing = variant(rec.config, "missing-db.json",
                      lambda d: d.update(database=str(tmp_path / "none.db")))
    code, out, err = recheck("-config", missing)
    assert code == 1 and "agentrt-proxy: error: " in err
    assert not any(name.startswith("none.db") for name in os.listdir(tmp_path))


def test_cli_recheck_as_a_process(rec):
    env = {k: v for k, v in os.environ.items() if k != "AGENTRT_DB"}
    p = subprocess.run([sys.executable, SCRIPT, "recheck", "-config",
                        os.path.basename(rec.config)], cwd=rec.dir, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    check_counts(summary(p.stdout), 3, 4, 0, 0)
    assert p.stderr == ""
    p = subprocess.run([sys.executable, SCRIPT, "recheck", "-config", rec.deny, "-json"],
                       env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 1
    assert [r["same"] for r in json.loads(p.stdout)] == [True, False, True]
    p = subprocess.run([sys.executable, SCRIPT, "recheck", "-config", rec.config, "-limit", "0"],
                       env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2 and p.stdout == ""


# ---- read-only: recheck writes nothing ----

def test_recheck_writes_nothing(rec, monkeypatch):
    before = snapshot(rec.db)
    uris = []
    real_connect = sqlite3.connect

    def spy(database, *a, **kw):
        uris.append(str(database))
        return real_connect(database, *a, **kw)
    monkeypatch.setattr(ap.sqlite3, "connect", spy)
    runs = [
        ("-config", rec.config), ("-config", rec.config, "-json"),
        ("-config", rec.deny), ("-config", rec.reworded, "-current-tools"),
        ("-config", rec.config, "-run", rec.pay), ("-config", rec.config, "-session", "other"),
        ("-config", rec.config, "-session", "nobody"), ("-config", rec.config, "-run", "nope"),
    ]
    for argv in runs:
        code, out, err = recheck(*argv)
        assert code in (0, 1), (argv, err)
    monkeypatch.undo()
    assert uris, "recheck opened no database"
    assert all("mode=ro" in u for u in uris), uris
    assert snapshot(rec.db) == before

    # It needs no write lock: it runs while another connection holds one.
    holder = sqlite3.connect(rec.db, timeout=1, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        code, out, err = recheck("-config", rec.config)      # a writer would wait, then fail
        assert code == 0, err
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert snapshot(rec.db)[:3] == before[:3]


def test_recheck_leaves_the_database_mode_alone(tmp_path):
    h = ProxyHarness(tmp_path)
    try:
        h.call("bank_balance", {"account": "A-1"}, timeout=CALL_TIMEOUT)
    finally:
        h.close()
    db = h.cfg.database
    os.chmod(db, 0o644)
    before = snapshot(db)
    code, out, err = recheck("-config", h.config_path)
    assert code == 0, err
    assert snapshot(db) == before
    assert oct(os.stat(db).st_mode & 0o777) == "0o644"


# ---- row 62 ----

def test_cli_recheck_of_nothing_fails(tmp_path):
    h = ProxyHarness(tmp_path)
    try:
        r = h.call("bank_balance", {"account": "A-1"}, timeout=CALL_TIMEOUT)
        assert "account A-1 holds" in h.text(r)
        [run] = h.runs()
    finally:
        h.close()
    cfg = h.config_path

    code, out, err = recheck("-config", cfg, "-session", "no-such-session")
    assert code == 1
    assert '"no-such-session"' in err and "no run" in err and "nothing was re-checked" in err
    assert err.startswith("agentrt-proxy: recheck: ")
    check_counts(summary(out), 0, 0, 0, 0)
    code, out, err = recheck("-config", cfg, "-session", "no-such-session", "-json")
    assert code == 1 and json.loads(out) == [] and out.strip() == "[]"

    code, out, err = recheck("-config", cfg)
    assert code == 0, err

    # A decision the policy failed to make: its step.policy is gone, a policy error recorded.
    conn = sqlite3.connect(h.cfg.database, isolation_level=None)
    try:
        [(step_id, at)] = conn.execute("SELECT step_id, at FROM events WHERE run_id=? AND "
                                       "type='step.policy'", (run.id,)).fetchall()
        conn.execute("DELETE FROM events WHERE type='step.policy'")
        conn.execute("INSERT INTO events (run_id, step_id, at, type, payload_json) "
                     "VALUES (?,?,?,?,?)", (run.id, step_id, at, "step.failed",
                                            json.dumps({"detail": "policy error: rules "
                                                                  "unavailable"})))
    finally:
        conn.close()
    code, out, err = recheck("-config", cfg)
    assert code == 1
    check_counts(summary(out), 1, 0, 1, 0)
    assert "policy failed; no evaluation recorded: rules unavailable" in out
    assert "no decision of the policy was re-checked" in err
    assert re.search(r"\b1 not re-checkable", err), err
    assert err.startswith("agentrt-proxy: recheck: ")
    code, reps, err = recheck_json("-config", cfg)
    assert code == 1
    [rep] = reps
    assert [e["result"] for e in rep["evaluations"]] == ["not_recheckable"]
    assert rep["rechecked"] == 0 and rep["not_recheckable"] == 1


def test_recheck_of_a_decision_without_identity_says_so(tmp_path):
    """A decision recorded before the proxy had a policy identity: "policy identity unknown",
    and it is still re-checked."""
    h = ProxyHarness(tmp_path)
    try:
        h.call("bank_balance", {"account": "A-1"}, timeout=CALL_TIMEOUT)
    finally:
        h.close()
    conn = sqlite3.connect(h.cfg.database, isolation_level=None)
    try:
        [(seq, payload)] = conn.execute("SELECT seq, payload_json FROM events "
                                        "WHERE type='step.policy'").fetchall()
        doc = json.loads(payload)
        doc.pop("policy_id", None)
        conn.execute("UPDATE events SET payload_json=? WHERE seq=?", (json.dumps(doc), seq))
    finally:
        conn.close()
    code, out, err = recheck("-config", h.config_path)
    assert code == 0, err
    assert "policy identity unknown" in out and "policy unchanged" not in out
    check_counts(summary(out), 1, 1, 0, 0)


# ---- recheck, faults found in review ---------------------------------------------------------
# Each test's docstring names the finding it guards, in the finding's words.

def test_recheck_does_not_change_the_database_mode(tmp_path):
    """0a2b80f: recheck, which only reads, checked the database as a writer does and
    tightened a 0644 database to 0600. It opens the database without touching its mode."""
    h = ProxyHarness(tmp_path)
    try:
        h.call("bank_balance", {"account": "A-1"})
    finally:
        h.close()
    os.chmod(h.cfg.database, 0o644)
    out, err = io.StringIO(), io.StringIO()
    code = ap.main(["recheck", "-config", h.config_path], stdin=io.StringIO(""), stdout=out,
                   stderr=err)
    assert code == 0, err.getvalue()
    assert oct(os.stat(h.cfg.database).st_mode & 0o777) == "0o644"


def test_a_report_prints_and_keeps_its_key_order_whatever_an_edited_event_recorded():
    """An edited event can record an outcome that is not text: the report still prints
    every line, each bounded and sanitised, and its JSON keeps the order it always had."""
    report = ap.RecheckReport("r-1", "COMPLETED", "p", "current", notes=["n"])
    report.evaluations = [
        ap.Evaluation(0, "s", 3, "pay", "not_a_policy_evaluation", None, detail="a pause"),
        ap.Evaluation(1, "s", 4, "pay", "same", None, policy_id="p"),
        ap.Evaluation(2, "s", 5, "pay", "different", 7, rechecked=None, policy_id="p")]
    lines = report.lines()
    assert lines[1] == "DIFFERENT step 2 seq 5 pay: 7 -> none"
    assert "skipped   step 0 seq 3 pay: a pause" in lines
    assert list(report.as_json())[-5:] == ["same", "differences", "rechecked",
                                           "not_recheckable", "complete"]

"""Policy by argument value and by history (DESIGN.md section 9): a rule's `when` conditions
and its `limits`, through the real host-facing server, the real store and the real fake
payment server (tests/proxy_harness.py). Each payment that reached the server is a line of
its ledger, counted by ``h.payments()``.
"""

import contextlib
import json
import os
import sqlite3

import pytest

from proxy_harness import ProxyHarness, ap

PAY, STATUS = "bank_pay", "gate_status"
BASE = {
    "balance": {"side_effect": "read_only", "timeout": "10s"},
    "refund": {"side_effect": "destructive", "timeout": "10s"},
}
SMALL = {"if": {"properties": {"amount": {"type": "number", "maximum": 10}},
                 "required": ["amount"]},
         "outcome": "allow", "why": "small payment"}
HUGE = {"if": {"properties": {"amount": {"type": "number", "exclusiveMinimum": 1000}},
                "required": ["amount"]},
        "outcome": "deny", "why": "far too large"}
BLOCKED = {"if": {"properties": {"to": {"enum": ["mallory"]}}, "required": ["to"]},
           "outcome": "deny", "why": "blocked payee"}


def pay_rule(**extra):
    out = json.loads(json.dumps(BASE))
    out["pay"] = {"side_effect": "remote_mutation", "timeout": "10s", **extra}
    return out


@pytest.fixture
def make(harnesses):
    return harnesses


def config_error(tmp_path, rules, names=("bank",)):
    from proxy_harness import write_config
    path = write_config(str(tmp_path), rules, names=names)
    with pytest.raises(ap.ConfigError) as exc:
        ap.load_config(path)
    return str(exc.value)


# -- conditions --

def test_policy_small_allowed_large_asked_huge_denied(make):
    h = make(rules=pay_rule(when=[HUGE, SMALL]))
    r = h.call(PAY, {"to": "bob", "amount": 5})
    assert not h.is_error(r) and h.payments() == 1, h.text(r)
    r = h.call(PAY, {"to": "bob", "amount": 50})
    assert h.prefix(r) == "PENDING_APPROVAL" and h.payments() == 1
    r = h.call(PAY, {"to": "bob", "amount": 5000})
    assert h.prefix(r) == "DENIED" and h.payments() == 1
    assert "when[0]" in h.text(r) and "far too large" in h.text(r)
    [a] = h.pending()
    h.decide(a)
    r = h.call(PAY, {"to": "bob", "amount": 50})
    assert not h.is_error(r) and h.payments() == 2, h.text(r)


def test_policy_payee_allow_list(make):
    allow = {"if": {"properties": {"to": {"enum": ["alice", "bob"]}}, "required": ["to"]},
             "outcome": "allow", "why": "known payee"}
    h = make(rules=pay_rule(when=[allow], outcome="deny"))
    assert h.payments() == 0
    r = h.call(PAY, {"to": "alice", "amount": 3})
    assert not h.is_error(r) and h.payments() == 1, h.text(r)
    r = h.call(PAY, {"to": "eve", "amount": 3})
    assert h.prefix(r) == "DENIED" and h.payments() == 1


def test_policy_condition_deny_names_its_index_and_why(make):
    h = make(rules=pay_rule(when=[BLOCKED], outcome="allow"))
    r = h.call(PAY, {"to": "mallory", "amount": 1})
    assert h.prefix(r) == "DENIED" and h.payments() == 0
    assert "when[0]" in h.text(r) and "blocked payee" in h.text(r)


def test_policy_numbers_compare_exactly(make):
    h = make(rules=pay_rule(when=[SMALL]))
    r = h.call(PAY, {"to": "bob", "amount": 1}, raw_args=b'{"to":"bob","amount":1E1}')
    assert not h.is_error(r) and h.payments() == 1, h.text(r)
    r = h.call(PAY, None, raw_args=b'{"to":"bob","amount":10.000000000000000000001}')
    assert h.prefix(r) == "PENDING_APPROVAL" and h.payments() == 1
    # 1e400 is beyond what a model may send (a 64-bit float); what the validator makes of
    # it, read without that bound, is still exact.
    cond = ap.parse_conditions(ap.parse_json(json.dumps([SMALL]).encode()), "t")[0]
    big = ap.parse_json(b'{"amount":1e400}', strict=False)
    assert cond.schema.test(big, 1000)[0] is False
    assert cond.schema.test(ap.parse_json(b'{"amount":1E1}'), 1000)[0] is True


def test_policy_condition_sees_fixed_values(make):
    # The model cannot set `mode`; the operator's fixed value is what the condition reads.
    blocked = {"if": {"properties": {"mode": {"const": "slow"}}, "required": ["mode"]},
               "outcome": "deny", "why": "fixed mode is slow"}
    h = make(rules=pay_rule(when=[blocked], outcome="allow", fixed={"mode": "slow"}))
    r = h.call(PAY, {"to": "bob", "amount": 1})
    assert h.prefix(r) == "DENIED" and "fixed mode is slow" in h.text(r)
    assert h.payments() == 0


def test_policy_a_call_refused_unsent_is_not_counted():
    """A denied or fixed parameter the model sets (an input schema that leaves
    additionalProperties open lets it) is refused at the call, before anything is sent;
    under a limit the policy denies it first, so it never starts and spends nothing."""
    limits = ap.parse_limits(ap.parse_json(json.dumps([DAILY]).encode()), "t")
    rule = ap.Rule(side_effect="remote_mutation", outcome="allow", limits=limits,
                   fixed=(("mode", b'"plain"'),), deny=("currency",))
    spec = ap.ToolSpec("bank_pay", "", b"{}", "remote_mutation", 1.0)
    tool = ap.UpstreamTool(spec, "bank", "pay", rule, None)
    for extra, why in (({"mode": "slow"}, "fixed"), ({"currency": "EUR"}, "denied")):
        args = json.dumps({"to": "bob", "amount": 40, **extra}).encode()
        judged = ap.judge(tool, args, "allow", "by rule", lambda key, limit: 0)
        assert (judged.outcome, judged.reason) == (
            "deny", f'bank_pay: parameter "{list(extra)[0]}" is {why} by the operator')
    args = json.dumps({"to": "bob", "amount": 40}).encode()
    assert ap.judge(tool, args, "allow", "by rule", lambda key, limit: 0).outcome == "allow"


def test_policy_condition_errors_name_server_tool_and_index(tmp_path):
    cases = [
        ([SMALL, {"if": {}, "outcome": "allow", "colour": 1}], 'unknown field "colour"'),
        ([{"if": {}, "outcome": "maybe"}], 'outcome "maybe"'),
        ([{"outcome": "allow"}], "if is required"),
        ([{"if": {"type": "nothing"}, "outcome": "allow"}], "if:"),
        ([{"if": {"$ref": "http://x/y"}, "outcome": "allow"}], "if:"),
        ([{"if": {}, "outcome": "allow", "why": "x" * 201}], "201 characters"),
        ([{"if": {}, "outcome": "allow", "why": "a\u001bb"}], "U+001B"),
        ([{"if": {}, "outcome": "allow"}] * 33, "more than 32"),
    ]
    for i, (when, expected) in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        text = config_error(d, pay_rule(when=when))
        assert expected in text, text
        assert 'server "bank"' in text and 'tool "pay"' in text, text
        if len(when) <= 2:
            assert f"when[{len(when) - 1}]" in text, text


def test_policy_limit_errors(tmp_path):
    cases = [
        ([{"calls": 3}], "per is required"),
        ([{"calls": 3, "per": "0s"}], "not between 1s and 31d"),
        ([{"calls": 3, "per": "32d"}], "not between 1s and 31d"),
        ([{"calls": 3, "sum": "/amount", "max": 1, "per": "1h"}], "exactly one of calls or sum"),
        ([{"per": "1h"}], "exactly one of calls or sum"),
        ([{"calls": 0, "per": "1h"}], "calls must be a whole number"),
        ([{"calls": 2.5, "per": "1h"}], "calls must be a whole number"),
        ([{"sum": "amount", "max": 1, "per": "1h"}], "not a JSON Pointer"),
        ([{"sum": "/a\u001b[2J\u202e", "max": 1, "per": "1h"}], "U+001B, which is not printable"),
        ([{"sum": "/amount", "per": "1h"}], "max is required"),
        ([{"sum": "/amount", "max": -1, "per": "1h"}], "below 0"),
        ([{"sum": "/amount", "max": "ten", "per": "1h"}], "max must be a decimal"),
        ([{"sum": "/amount", "max": "1e40", "per": "1h"}], "not below 1e36"),
        ([{"sum": "/amount", "max": 1, "per": "1h", "over": "allow"}], 'over "allow"'),
        ([{"calls": 1, "per": "1h", "name": "a b"}], 'name "a b"'),
        ([{"calls": 1, "per": "1h", "name": "x"}, {"calls": 2, "per": "1h", "name": "x"}],
         "used twice"),
        ([{"calls": 1, "per": "1h"}] * 9, "more than 8"),
    ]
    for i, (limits, expected) in enumerate(cases):
        d = tmp_path / f"l{i}"
        d.mkdir()
        text = config_error(d, pay_rule(limits=limits))
        assert expected in text, text
        assert 'server "bank"' in text and 'tool "pay"' in text, text


def test_policy_shared_limit_written_differently_is_refused(tmp_path):
    rules = pay_rule(limits=[{"sum": "/amount", "max": 50, "per": "24h", "name": "daily"}])
    rules["refund"]["limits"] = [{"sum": "/amount", "max": 60, "per": "24h", "name": "daily"}]
    text = config_error(tmp_path, rules)
    assert 'limit named "daily" is written differently' in text, text
    # The same limit spelled another way is the same limit.
    rules["refund"]["limits"] = [{"sum": "/amount", "max": "50.0", "per": "24h",
                                  "name": "daily"}]
    from proxy_harness import write_config
    ap.load_config(write_config(str(tmp_path), rules))


def test_policy_identity_covers_conditions_and_limits(tmp_path):
    from proxy_harness import write_config
    ids = []
    for extra in ({}, {"when": [SMALL]}, {"when": [dict(SMALL, outcome="deny")]},
                  {"limits": [{"calls": 3, "per": "1h"}]},
                  {"limits": [{"calls": 4, "per": "1h"}]}):
        ids.append(ap.load_config(write_config(str(tmp_path), pay_rule(**extra))).policy_id())
    assert len(set(ids)) == len(ids)
    # A rule without either keeps the identity it had.
    plain = ap.load_config(write_config(str(tmp_path), pay_rule())).policy_id()
    assert plain == ids[0]


# -- limits --

DAILY = {"sum": "/amount", "max": "50", "per": "24h", "name": "daily-spend"}


def test_policy_sum_limit_asks_with_the_figures_and_names_the_limit(make):
    h = make(rules=pay_rule(outcome="allow", limits=[DAILY]))
    for amount in (20, 25):
        r = h.call(PAY, {"to": "bob", "amount": amount})
        assert not h.is_error(r), h.text(r)
    r = h.call(PAY, {"to": "bob", "amount": 10})
    assert h.prefix(r) == "PENDING_APPROVAL" and h.payments() == 2
    [a] = h.pending()
    cap, pres = json.loads(a.capability), json.loads(a.presentation)
    assert cap["asked_by"] == ["daily-spend"]
    assert "45" not in json.dumps(cap)             # never the running figures
    assert pres["figures"] == ['limit "daily-spend" of bank_pay: 45 of 50 in the last 24h; '
                               'this call adds 10']
    block = "\n".join(ap.approval_block(h.store, a, h.cfg.database))
    assert "daily-spend" in block and "45 of 50" in block
    doc = ap.waiting_doc(a, h.cfg.database)
    assert doc["asked_by"] == ["daily-spend"]
    assert doc["figures"] == pres["figures"]
    h.decide(a)
    r = h.call(PAY, {"to": "bob", "amount": 10})
    assert not h.is_error(r) and h.payments() == 3, h.text(r)


def test_policy_grant_covers_while_over_and_window_moves(make):
    h = make(rules=pay_rule(outcome="allow", limits=[DAILY]))
    h.call(PAY, {"to": "bob", "amount": 45})
    r = h.call(PAY, {"to": "bob", "amount": 10})
    [a] = h.pending()
    h.decide(a)
    h.clock.skew += 3600                      # the window moved; still over
    r = h.call(PAY, {"to": "bob", "amount": 10})
    assert not h.is_error(r) and h.payments() == 2, h.text(r)


def test_policy_no_longer_over_at_collection_is_allowed(make):
    h = make(rules=pay_rule(outcome="allow", limits=[dict(DAILY, per="1h")]))
    h.call(PAY, {"to": "bob", "amount": 45})
    h.call(PAY, {"to": "bob", "amount": 10})
    [a] = h.pending()
    h.clock.skew += 3700                      # the 45 left the window: the call is under
    h.decide(a)
    r = h.call(PAY, {"to": "bob", "amount": 10})
    assert not h.is_error(r) and h.payments() == 2, h.text(r)


def test_policy_condition_grant_does_not_cover_a_limit_crossed_since(make):
    large = {"if": {"properties": {"amount": {"type": "number", "exclusiveMinimum": 10}}},
             "outcome": "require_approval", "why": "large payment"}
    h = make(rules=pay_rule(outcome="allow", when=[large], limits=[DAILY]))
    r = h.call(PAY, {"to": "bob", "amount": 30})
    [a] = h.pending()
    assert json.loads(a.capability)["asked_by"] == ["when[0]"]
    h.decide(a)
    h.call(PAY, {"to": "carol", "amount": 10})      # small, allowed: 10 of 50
    h.call(PAY, {"to": "dave", "amount": 10})       # 20 of 50
    h.call(PAY, {"to": "erin", "amount": 5})        # 25 of 50; the 30 would cross it
    assert h.payments() == 3
    r = h.call(PAY, {"to": "bob", "amount": 30})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    assert h.payments() == 3
    again = [p for p in h.pending()]
    assert json.loads(again[-1].capability)["asked_by"] == ["when[0]", "daily-spend"]


def test_policy_calls_limit_over_deny_names_use_and_max(make):
    h = make(rules=pay_rule(outcome="allow",
                            limits=[{"calls": 2, "per": "1h", "over": "deny"}]))
    for i in range(2):
        assert not h.is_error(h.call(PAY, {"to": f"p{i}", "amount": 1}))
    r = h.call(PAY, {"to": "p3", "amount": 1})
    assert h.prefix(r) == "DENIED" and h.payments() == 2
    text = h.text(r)
    assert "limits[0]" in text and "2 of 2 calls" in text and "max of 2" in text, text
    h.clock.skew += 3601
    assert not h.is_error(h.call(PAY, {"to": "p4", "amount": 1}))
    assert h.payments() == 3


def test_policy_uncountable_value_is_denied_and_nothing_sent(make):
    h = make(rules=pay_rule(outcome="allow",
                            limits=[{"sum": "/currency", "max": 5, "per": "1h"}]))
    r = h.call(PAY, {"to": "bob", "amount": 1})
    assert h.prefix(r) == "DENIED" and "/currency is missing" in h.text(r), h.text(r)
    r = h.call(PAY, {"to": "bob", "amount": 1, "currency": "EUR"})
    assert h.prefix(r) == "DENIED" and "not a number" in h.text(r), h.text(r)
    h2 = make("neg", rules=pay_rule(outcome="allow",
                                    limits=[{"sum": "/amount", "max": 5, "per": "1h"}]))
    r = h2.call(PAY, {"to": "bob", "amount": -1})
    assert h2.prefix(r) == "DENIED" and "negative" in h2.text(r), h2.text(r)
    assert h.payments() == 0 and h2.payments() == 0


def test_policy_unknown_outcome_counts(make):
    h = make(rules=pay_rule(outcome="allow", timeout="300ms",
                            limits=[{"calls": 1, "per": "1h", "over": "deny"}]))
    r = h.call(PAY, {"to": "bob", "amount": 1, "mode": "slow"})
    assert h.prefix(r) == "UNKNOWN_OUTCOME", h.text(r)
    use = h.proxy.budgets.lines()
    assert use == ["bank_pay: 1 of 1 (calls) in the last 1h"], use
    # The limit denies a re-run, yet the operator is asked at once (seed rule 6: a
    # limit's deny does not stop the question), and the tool is BLOCKED meanwhile.
    assert [a.kind for a in h.pending()] == ["interrupted_side_effect"]
    r = h.call(PAY, {"to": "carol", "amount": 1})
    assert h.prefix(r) == "BLOCKED", h.text(r)
    h.clock.skew += 3700
    r = h.call(PAY, {"to": "carol", "amount": 1})
    assert h.prefix(r) == "BLOCKED", h.text(r)
    assert [a.kind for a in h.pending()] == ["interrupted_side_effect"]
    assert h.payments() <= 1


def test_policy_refused_and_waiting_calls_do_not_count(make):
    asks = {"if": {"properties": {"to": {"const": "ask"}}, "required": ["to"]},
            "outcome": "require_approval"}
    h = make(rules=pay_rule(outcome="allow", when=[BLOCKED, asks],
                            limits=[{"calls": 1, "per": "1h", "over": "deny"}]))
    assert h.prefix(h.call(PAY, {"to": "mallory", "amount": 1})) == "DENIED"
    assert h.prefix(h.call(PAY, {"to": "ask", "amount": 1})) == "PENDING_APPROVAL"
    assert h.proxy.budgets.lines() == ["bank_pay: 0 of 1 (calls) in the last 1h"]
    assert not h.is_error(h.call(PAY, {"to": "bob", "amount": 1}))
    assert h.payments() == 1


def test_policy_daily_cap_shared_by_two_tools_on_two_servers(make):
    h = make(rules=pay_rule(outcome="allow", limits=[DAILY]), names=("bank", "bank2"))
    assert not h.is_error(h.call("bank_pay", {"to": "bob", "amount": 30}))
    assert not h.is_error(h.call("bank2_pay", {"to": "bob", "amount": 20}))
    r = h.call("bank2_pay", {"to": "carol", "amount": 1})
    assert h.prefix(r) == "PENDING_APPROVAL" and h.payments() == 2
    lines = h.proxy.budgets.lines()
    assert 'bank_pay: 50 of 50 (sum of /amount, limit "daily-spend") in the last 24h' in lines


def test_policy_gate_status_lists_each_limit(make):
    h = make(rules=pay_rule(outcome="allow", limits=[{"sum": "/amount", "max": 10,
                                                      "per": "24h"}]))
    h.call(PAY, {"to": "bob", "amount": 4})
    text = h.text(h.call(STATUS, {}))
    assert "bank_pay: 4 of 10 (sum of /amount) in the last 24h" in text, text


def test_policy_counts_survive_a_restart(tmp_path):
    rules = pay_rule(outcome="allow", limits=[{"calls": 1, "per": "1h", "over": "deny"}])
    (tmp_path / "h").mkdir()
    h = ProxyHarness(tmp_path / "h", rules=rules)
    try:
        assert not h.is_error(h.call(PAY, {"to": "bob", "amount": 1}))
    finally:
        h.close()
    again = ProxyHarness(tmp_path / "h", rules=rules, pin=False)
    try:
        r = again.call(PAY, {"to": "carol", "amount": 1})
        assert again.prefix(r) == "DENIED", again.text(r)
    finally:
        again.close()


def test_policy_check_at_start_refuses_a_forecast_the_count_overtook(make, monkeypatch):
    """The in-transaction check: the evaluation's forecast is told the limit is empty, as if
    another process's start had not yet been seen; the start itself counts again, refuses,
    and the call is decided again on the true count."""
    h = make(rules=pay_rule(outcome="allow", limits=[{"calls": 1, "per": "1h"}]))
    assert not h.is_error(h.call(PAY, {"to": "bob", "amount": 1}))
    real = h.proxy.budgets.use_of
    stale = [True]

    def forecast(key, limit):
        if stale:
            stale.pop()
            return 0
        return real(key, limit)
    monkeypatch.setattr(h.proxy.budgets, "use_of", forecast)
    r = h.call(PAY, {"to": "carol", "amount": 1})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    assert h.payments() == 1 and not stale


def test_policy_use_query_is_two_index_searches(tmp_path):
    store = ap.Store.open(str(tmp_path / "db"))
    try:
        ap.CallIndex(store, "s").migrate(0.0)
        plan = store._read("EXPLAIN QUERY PLAN " + ap._USE_SQL, ("k", 1.0))
        details = [row[-1] for row in plan]
        assert not any(d.startswith("SCAN") and "proxy_limit_uses" in d for d in details), \
            details
        searches = [d for d in details if d.startswith("SEARCH")]
        assert len(searches) == 2, details
    finally:
        store.close()


def test_policy_units_are_exact_and_bounded():
    units = ap.to_units
    assert units(ap.Num("10.000000000000000000001")) > units(ap.Num("10"))
    assert units(ap.Num("1E1")) == units(ap.Num("10")) == units(ap.Num("10.0"))
    assert units(ap.Num("1e400")) == ap._CAP
    assert units(ap.Num("1e-999999")) == 1         # below a unit: counted up, never free
    assert units(ap.Num("0.1")) + units(ap.Num("0.2")) == units(ap.Num("0.3"))
    assert ap.fmt_units(units(ap.Num("12.50"))) == "12.5"


# -- the README's recipes, as written --

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_server.py")


def recipe(name):
    text = open(README, encoding="utf-8").read()
    marker = f"<!-- recipe: {name} -->\n```json\n"
    assert text.count(marker) == 1, name
    body = text.split(marker, 1)[1].split("```", 1)[0]
    return json.loads(body)


def with_base(rules):
    out = json.loads(json.dumps(BASE))
    out.update(rules)
    return out


def standin(make, name, rules):
    d_rules = json.loads(json.dumps(rules))
    h = make(name, rules=d_rules, names=("dev",), command=[ap.sys.executable, STANDIN],
             server_env=[])
    return h


def standin_calls(h):
    path = os.path.join(h.tmp, "ledger")
    return open(path).read().count("\n") if os.path.exists(path) else 0


def test_readme_recipe_small_large_huge(make):
    h = make(rules=with_base(recipe("small-large-huge")))
    assert not h.is_error(h.call(PAY, {"to": "bob", "amount": 20})) and h.payments() == 1
    assert h.prefix(h.call(PAY, {"to": "bob", "amount": 20.5})) == "PENDING_APPROVAL"
    r = h.call(PAY, {"to": "bob", "amount": 1000.01})
    assert h.prefix(r) == "DENIED" and "never paid by a model" in h.text(r)
    assert h.payments() == 1


def test_readme_recipe_payee_allow_list(make):
    h = make(rules=with_base(recipe("payee-allow-list")))
    assert not h.is_error(h.call(PAY, {"to": "alice", "amount": 5}))
    assert h.prefix(h.call(PAY, {"to": "mallory", "amount": 5})) == "DENIED"
    assert h.payments() == 1


def test_readme_recipe_shared_daily_cap(make):
    h = make(rules=with_base(recipe("shared-daily-cap")), names=("bank", "bank2"))
    assert not h.is_error(h.call("bank_pay", {"to": "bob", "amount": 150}))
    assert not h.is_error(h.call("bank2_pay", {"to": "bob", "amount": 50}))
    r = h.call("bank_pay", {"to": "carol", "amount": 0.01})
    assert h.prefix(r) == "PENDING_APPROVAL" and h.payments() == 2
    [a] = h.pending()
    assert json.loads(a.capability)["asked_by"] == ["daily-spend"]
    assert 'limit "daily-spend" of bank_pay: 200 of 200' in json.loads(a.presentation)[
        "figures"][0]
    h.clock.skew += 24 * 3600 + 1            # a new day (the approval waits, unexpired)
    assert not h.is_error(h.call("bank2_pay", {"to": "dave", "amount": 1}))


def test_readme_recipe_commits_per_hour(make, tmp_path):
    h = make(rules=recipe("commits-per-hour"), names=("dev",),
             command=[ap.sys.executable, STANDIN],
             server_env=[f"STANDIN_LEDGER={tmp_path}/h/ledger"])
    for i in range(5):
        r = h.call("dev_git_commit", {"repo_path": "/r", "message": f"change {i}"})
        assert not h.is_error(r), h.text(r)
    r = h.call("dev_git_commit", {"repo_path": "/r", "message": "change 5"})
    assert h.prefix(r) == "DENIED" and "5 of 5 calls" in h.text(r), h.text(r)
    assert standin_calls(h) == 5


def test_readme_recipe_path_prefix(make, tmp_path):
    h = make(rules=recipe("path-prefix"), names=("dev",),
             command=[ap.sys.executable, STANDIN],
             server_env=[f"STANDIN_LEDGER={tmp_path}/h/ledger"])
    ok = h.call("dev_write_file", {"path": "/home/me/sandbox/notes.txt", "content": "x"})
    assert not h.is_error(ok), h.text(ok)
    for path in ("/home/me/.ssh/authorized_keys", "/home/me/sandbox/../.ssh/config",
                 "/home/me/sandbox/a/..", "/home/me/sandboxed/x"):
        r = h.call("dev_write_file", {"path": path, "content": "x"})
        assert h.prefix(r) == "PENDING_APPROVAL", (path, h.text(r))
    assert standin_calls(h) == 1


def test_check_prints_conditions_limits_and_warnings(tmp_path):
    from process_helpers import ProcessDir
    # amount is required by pay's input schema; currency is not.
    loose = {"if": {"properties": {"amount": {"type": "number", "maximum": 10},
                                   "currency": {"enum": ["EUR"]}}},
             "outcome": "allow"}
    rules = pay_rule(when=[BLOCKED, loose], limits=[DAILY])
    d = ProcessDir(tmp_path, rules=rules)
    code, out, err = d.check()
    assert code == 0, err
    assert 'bank_pay: when[0] -> deny (blocked payee): if {"properties"' in out, out
    assert 'bank_pay: limit "daily-spend": at most 50 (sum of /amount) in any 24h; over it: ' \
           'require_approval' in out, out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "when[1]" in warnings[0] and '"currency"' in warnings[0], out
    assert '"amount"' not in warnings[0]
    # Required by the condition: no warning.
    rules = pay_rule(when=[BLOCKED, SMALL])
    d.write_config(rules)
    code, out, err = d.check()
    assert code == 0 and "warning:" not in out, out


def test_policy_every_operator_view_shows_what_asked(make):
    h = make(rules=pay_rule(outcome="allow", limits=[DAILY]))
    h.call(PAY, {"to": "bob", "amount": 45})
    h.call(PAY, {"to": "bob", "amount": 10})
    [a] = h.pending()
    figures = 'limit "daily-spend" of bank_pay: 45 of 50 in the last 24h; this call adds 10'
    block = ap.approval_block(h.store, a, h.cfg.database)
    assert "asked by      daily-spend" in block and f"  {figures}" in block, block
    entry = ap.pending_entry(h.store, a, ap.time.time())
    assert entry["asked_by"] == ["daily-spend"] and entry["figures"] == [figures]
    lines = ap._pending_lines(entry)
    assert "  asked by daily-spend" in lines and f"    {figures}" in lines, lines
    hook = ap._hook_approval(h.store, a)
    assert hook["asked_by"] == ["daily-spend"] and hook["figures"] == [figures]


def test_recheck_evaluates_conditions_and_limits_as_they_stood(make):
    rules = pay_rule(outcome="allow", when=[BLOCKED], limits=[DAILY])
    h = make(rules=rules)
    for to, amount in (("bob", 30), ("carol", 15), ("dave", 10), ("mallory", 1)):
        h.call(PAY, {"to": to, "amount": amount})
    assert h.payments() == 2 and len(h.pending()) == 1

    def recheck(rules_now):
        cfg = ap.load_config(_config_in(h, rules_now))
        policy = ap._RecordedPolicy(cfg, ap.configured_tools(cfg), cfg.policy_id(), h.store)
        out = {}
        for run in h.runs():
            report = ap.recheck_run(h.store, run.id, policy, None)
            out[run.id] = [(e.result, e.recorded, e.rechecked) for e in report.evaluations
                           if e.result in ("same", "different")]
        return out
    same = recheck(rules)
    assert all(r == "same" for ev in same.values() for r, _, _ in ev), same
    # A lower max: the second payment (30 + 15 > 40) would now have asked.
    lower = pay_rule(outcome="allow", when=[BLOCKED], limits=[dict(DAILY, max="40")])
    diff = recheck(lower)
    changed = [ev for ev in diff.values() if any(r == "different" for r, _, _ in ev)]
    assert [("different", "allow", "require_approval")] in changed, diff
    # Without the blocked-payee condition, mallory's call would have run.
    loose = pay_rule(outcome="allow", limits=[DAILY])
    diff = recheck(loose)
    assert any(("different", "deny", "allow") in ev for ev in diff.values()), diff


def _config_in(h, rules):
    from proxy_harness import write_config
    d = os.path.join(h.tmp, "again")
    os.makedirs(d, exist_ok=True)
    path = write_config(d, rules)
    # The same database: recheck reads the harness's store.
    doc = json.load(open(path))
    doc["database"] = h.cfg.database
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def test_policy_check_at_start_of_a_collected_grant(make, monkeypatch):
    """A grant asked by a condition, collected while the forecast misses a limit the count
    crossed: the start refuses, and the call asks again, naming the limit too."""
    large = {"if": {"properties": {"amount": {"type": "number", "exclusiveMinimum": 10}}},
             "outcome": "require_approval", "why": "large payment"}
    h = make(rules=pay_rule(outcome="allow", when=[large],
                            limits=[{"sum": "/amount", "max": 40, "per": "1h", "name": "cap"}]))
    assert h.prefix(h.call(PAY, {"to": "bob", "amount": 30})) == "PENDING_APPROVAL"
    h.decide(h.pending()[0])
    for to in ("c", "d"):
        assert not h.is_error(h.call(PAY, {"to": to, "amount": 10}))     # 20 of 40
    real = h.proxy.budgets.use_of
    stale = [True]

    def forecast(key, limit):
        if stale:
            stale.pop()
            return 0
        return real(key, limit)
    monkeypatch.setattr(h.proxy.budgets, "use_of", forecast)
    r = h.call(PAY, {"to": "bob", "amount": 30})
    assert h.prefix(r) == "PENDING_APPROVAL", h.text(r)
    assert h.payments() == 2 and not stale
    newest = h.pending()[-1]
    assert json.loads(newest.capability)["asked_by"] == ["when[0]", "cap"]


def test_policy_conditions_share_one_checks_budget():
    """32 conditions, each affordable alone on a 60,000-item array, cost together more than
    one check may spend: the call is denied, naming the condition where the budget ran out,
    never checked 32 times over."""
    cond = {"if": {"properties": {"x": {"type": "array", "items": {
                "type": "number", "minimum": 0, "maximum": 10}}},
                   "required": ["y"]}, "outcome": "allow"}
    when = ap.parse_conditions(ap.parse_json(json.dumps([cond] * 32).encode()), "t")
    alone, _ = when[0].schema.test(ap.parse_json(json.dumps({"x": [1] * 60000}).encode()),
                                   ap.MAX_SCHEMA_EVALUATIONS)
    assert alone is False                               # affordable alone: it just fails
    rule = ap.Rule(side_effect="remote_mutation", when=when)
    spec = ap.ToolSpec("bank_pay", "", b"{}", "remote_mutation", 1.0)
    tool = ap.UpstreamTool(spec, "bank", "pay", rule, None)
    args = json.dumps({"x": [1] * 60000}).encode()
    judged = ap.judge(tool, args, "require_approval", "by class", None)
    assert judged.outcome == "deny" and "could not be evaluated" in judged.reason, judged
    assert judged.reason.startswith("when[")


def test_policy_a_new_limit_counts_what_already_ran(tmp_path):
    """What counts is what the store recorded: a limit added to a rule counts the tool's
    executions already within its window, once, however many proxies start on it."""
    d = tmp_path / "h"
    d.mkdir()
    h = ProxyHarness(d, rules=pay_rule(outcome="allow"))
    try:
        for to, amount in (("bob", 20), ("carol", 25)):
            assert not h.is_error(h.call(PAY, {"to": to, "amount": amount}))
    finally:
        h.close()
    rules = pay_rule(outcome="allow", limits=[DAILY])
    first = ProxyHarness(d, rules=rules, pin=False)
    second = ProxyHarness(d, rules=rules, pin=False)     # a second start: nothing twice
    try:
        assert first.proxy.budgets.lines() == [
            'bank_pay: 45 of 50 (sum of /amount, limit "daily-spend") in the last 24h']
        r = second.call(PAY, {"to": "dave", "amount": 10})
        assert second.prefix(r) == "PENDING_APPROVAL", second.text(r)
    finally:
        second.close()
        first.close()


def test_policy_a_longer_window_counts_from_the_history(tmp_path):
    d = tmp_path / "h"
    d.mkdir()
    short = dict(DAILY, per="1h")
    h = ProxyHarness(d, rules=pay_rule(outcome="allow", limits=[short]))
    try:
        assert not h.is_error(h.call(PAY, {"to": "bob", "amount": 40}))
        h.clock.skew = 2 * 3600            # the 40 has left the 1h window
        assert not h.is_error(h.call(PAY, {"to": "carol", "amount": 5}))
    finally:
        h.close()
    again = ProxyHarness(d, rules=pay_rule(outcome="allow", limits=[DAILY]), pin=False)
    try:
        again.clock.skew = 2 * 3600
        assert again.proxy.budgets.lines() == [
            'bank_pay: 45 of 50 (sum of /amount, limit "daily-spend") in the last 24h']
    finally:
        again.close()


def _serve_and_pay(d, limits, calls, pin=False):
    """One proxy on the directory's database under ``limits``: the calls, each paid or not;
    then what gate_status says of the limits."""
    h = ProxyHarness(d, rules=pay_rule(outcome="allow", limits=limits), pin=pin)
    try:
        said = [h.prefix(h.call(PAY, {"to": to, "amount": amount})) for to, amount in calls]
        return said, h.proxy.budgets.lines(), h.payments()
    finally:
        h.close()


def test_policy_a_window_changed_and_changed_back_counts_what_ran_between(tmp_path):
    """A 24h limit moved to 1h and back: what ran under the 1h window was never written to
    the 24h counter, and counts in it at the next start."""
    d = tmp_path / "h"
    d.mkdir()
    day = {k: v for k, v in DAILY.items() if k != "name"}
    assert _serve_and_pay(d, [day], [("a", 20)], pin=True)[2] == 1
    assert _serve_and_pay(d, [dict(day, per="1h")], [("b", 25)])[2] == 2
    said, lines, paid = _serve_and_pay(d, [day], [("c", 25)])
    assert lines == ["bank_pay: 45 of 50 (sum of /amount) in the last 24h"], lines
    assert said == ["PENDING_APPROVAL"] and paid == 2, (said, lines)


def test_policy_a_limit_removed_and_restored_counts_what_ran_without_it(tmp_path):
    d = tmp_path / "h"
    d.mkdir()
    assert _serve_and_pay(d, [DAILY], [("a", 20)], pin=True)[2] == 1
    assert _serve_and_pay(d, [], [("b", 30)])[2] == 2             # no limit: nothing counted
    said, lines, paid = _serve_and_pay(d, [DAILY], [("c", 1)])
    assert lines == ['bank_pay: 50 of 50 (sum of /amount, limit "daily-spend") in the last 24h']
    assert said == ["PENDING_APPROVAL"] and paid == 2
    said, lines, _ = _serve_and_pay(d, [DAILY], [])               # caught up once, not twice
    assert lines == ['bank_pay: 50 of 50 (sum of /amount, limit "daily-spend") in the last 24h']


def test_policy_catching_up_reads_only_the_events_since_the_last_start(tmp_path):
    """The mark: a start after one that caught up walks the events recorded since, not the
    history (the query's lower bound is the mark's event)."""
    d = tmp_path / "h"
    d.mkdir()
    _serve_and_pay(d, [DAILY], [("a", 1), ("b", 2)], pin=True)
    _serve_and_pay(d, [DAILY], [("c", 3)])
    conn = sqlite3.connect(str(d / "runs.db"))
    try:
        (seq, n), = conn.execute("SELECT seq, n FROM proxy_limit_marks").fetchall()
        top, = conn.execute("SELECT MAX(seq) FROM events").fetchone()
        plan = " ".join(r[3] for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT at, run_id, step_id, payload_json FROM events WHERE "
            "seq>? AND seq<=? AND type='step.tool_started' AND at>? ORDER BY seq",
            (seq, top, "")))
    finally:
        conn.close()
    assert n == 2 and 0 < seq < top              # marked at the second start, before c
    assert "USING INTEGER PRIMARY KEY (rowid>? AND rowid<?)" in plan, plan


def test_policy_a_memoised_pattern_step_is_charged():
    """A pattern's memoised steps cost a visit a character, so a long string spends the
    budget however cheap each step became; 32 conditions on a 2 MB string are denied for
    their cost, evaluated once for the call's rules and its policy."""
    rx = ap.Pattern("^(a|aa)*b$")
    s = "a" * 100_000
    assert rx.search_costed(s, 10 ** 9)[1] >= len(s)
    cond = {"if": {"properties": {"to": {"type": "string", "pattern": "^(a|aa)*b$"}}},
            "outcome": "allow"}
    when = ap.parse_conditions(ap.parse_json(json.dumps([cond] * 32).encode()), "t")
    rule = ap.Rule(side_effect="remote_mutation", when=when)
    spec = ap.ToolSpec("bank_pay", "", b"{}", "remote_mutation", 1.0)
    tool = ap.UpstreamTool(spec, "bank", "pay", rule, None)
    args = json.dumps({"to": "a" * 2_000_000, "amount": 1}).encode()
    seen: dict = {}
    tested = []
    for c in when:
        real = c.schema.test
        object.__setattr__(c.schema, "test", lambda v, b, real=real: (tested.append(1),
                                                                      real(v, b))[1])
    first = ap.judge(tool, args, "require_approval", "by class", None, seen)
    runs = len(tested)
    again = ap.judge(tool, args, "require_approval", "by class", None, seen)
    assert first.outcome == again.outcome == "deny", first
    assert "could not be evaluated" in first.reason, first
    assert len(tested) == runs and 0 < runs < 32, runs


@pytest.mark.parametrize("edited", ["'edited'", "9e999"])
def test_policy_an_edited_use_time_neither_stops_the_start_nor_counts_twice(tmp_path, edited):
    """A use row whose time was edited into text or infinity: the next start catches its
    limit up without failing, and counts the execution it records once (catch_up compares
    a row's time only with an operator's word on its step, and there is none)."""
    d = tmp_path / "h"
    d.mkdir()
    assert _serve_and_pay(d, [DAILY], [("a", 20)], pin=True)[2] == 1
    with contextlib.closing(sqlite3.connect(str(d / "runs.db"))) as conn, conn:
        first = conn.execute("SELECT run_id FROM proxy_limit_uses").fetchall()
        conn.execute(f"UPDATE proxy_limit_uses SET at={edited}")
    _serve_and_pay(d, [DAILY], [("b", 5)])
    with contextlib.closing(sqlite3.connect(str(d / "runs.db"))) as conn:
        counted = conn.execute("SELECT COUNT(*) FROM proxy_limit_uses WHERE run_id=?",
                               first[0]).fetchone()[0]
    assert len(first) == 1 and counted == 1, counted

"""A late outcome matches the attempt it ends one way everywhere: an operator's decision
(late_record) and the settling of the approvals asking about it (settle_attempt) agree when
the attempt's start is not text."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import agentrt_proxy as ap  # noqa: E402

START = "2026-01-01T00:00:00.000000Z"


def query(started_at):
    payload = json.dumps({"late": True, "known": True, "started_at": started_at,
                          "observation": {"kind": ap.TOOL_RESULT, "content": {}}})
    return lambda sql, params: [(7, "2026-01-01T00:00:05.000000Z", payload)]


def test_attempt_whose_start_is_not_text_is_not_the_attempt_an_event_names():
    for odd in (None, 5, {"at": START}):
        attempt = {"run_id": "r1", "step_id": "s1", "started_at": odd}
        assert ap.late_record(query(START), attempt, known=True) is None
        late = ap.late_record(query(START), dict(attempt, started_at=START), known=True)
        assert late is not None and late.answers(dict(attempt, started_at=START))
        assert not late.answers(attempt)


def test_event_naming_no_start_answers_every_attempt_of_its_step():
    attempt = {"run_id": "r1", "step_id": "s1", "started_at": None}
    late = ap.late_record(query(""), attempt, known=True)
    assert late is not None and late.seq == 7

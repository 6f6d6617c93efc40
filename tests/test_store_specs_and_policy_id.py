"""Two edges of the store and the policy identity.

- A spec found only inside this thread's open transaction is not taken as stored: if that
  transaction rolls back, the next ensure_spec stores it, and the store can read it back.
- A policy identity that is too long is refused by its size in bytes, measured one way,
  even when it holds lone surrogates (which it would be refused for next).
"""

import pytest

from conftest import BALANCE, ap


def test_a_spec_seen_in_a_rolled_back_transaction_is_stored_again(tmp_path):
    store = ap.Store.open(str(tmp_path / "db"))
    try:
        with pytest.raises(RuntimeError):
            with store.tx() as tx:
                tx.save_spec(BALANCE)
                store.ensure_spec(BALANCE)      # finds the uncommitted row
                raise RuntimeError("roll back")
        store.ensure_spec(BALANCE)
        assert store.spec(BALANCE.hash()).name == BALANCE.name
    finally:
        store.close()


def test_a_long_policy_identity_with_surrogates_is_refused_by_its_size():
    pid = "\ud800" * 100                        # 300 bytes as UTF-8 with surrogatepass
    with pytest.raises(ValueError) as caught:
        ap.check_policy_id(pid)
    assert str(caught.value) == (f"policy identity is 300 bytes, more than "
                                 f"{ap.MAX_POLICY_ID_BYTES}")

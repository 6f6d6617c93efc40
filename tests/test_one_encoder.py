"""One JSON encoder writes the three forms, and each keeps its own rules.

- The proxy's own encoding (dump_json) keeps members in the order given and takes tuples,
  ints and RawJSON fragments.
- The canonical form sorts keys and takes parsed values alone: an int, a tuple or a fragment
  is refused, so no fragment's bytes can reach a hash.
- The policy form sorts keys and leaves <, > and & as they are.
"""

import pytest

from proxy_harness import ap


def test_the_own_encoding_keeps_the_order_given_and_takes_its_fragments():
    value = {"b": 1, "a": (ap.Num("1.0"), True, None, False), "c": ap.RawJSON(b'{"z":1,"y":2}')}
    assert ap.dump_json(value) == '{"b":1,"a":[1.0,true,null,false],"c":{"z":1,"y":2}}'


@pytest.mark.parametrize("value", [1, (ap.Num("1"),), ap.RawJSON(b"{}"), {"a": [1]}],
                         ids=["int", "tuple", "fragment", "nested int"])
def test_the_canonical_form_takes_parsed_values_alone(value):
    with pytest.raises(TypeError, match="not a JSON value"):
        ap.encode_canonical(value)


def test_the_canonical_and_policy_forms_sort_keys():
    value = ap.parse_json(b'{"b":"<&>","a":[true,null,1.50]}')
    assert ap.encode_canonical(value) == b'{"a":[true,null,1.50],"b":"\\u003c\\u0026\\u003e"}'
    assert ap.encode_policy(value) == b'{"a":[true,null,1.50],"b":"<&>"}'


def test_a_float_is_never_written_into_a_record():
    with pytest.raises(TypeError, match="floats are not written into records"):
        ap.dump_json({"a": 1.5})

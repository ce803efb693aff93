"""What the fuzz tests share: hypothesis strategies for junk values, and a server profile that keeps
every valid request cheap (short contexts, few tokens)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

CHEAP = json.dumps({"0": {"max_model_len": 160, "default_sampling_params": {"max_tokens": 8}},
                    "1": {"max_model_len": 192, "default_sampling_params": {"max_tokens": 16}}})

leaf = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=12))
junk = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)
small_ints = st.sampled_from([-(2**63), -1, 0, 1, 2, 5, 8, 2**31, 2**63, 2**64]) | st.integers(-3, 12)


def sometimes_junk(strategy):
    """Mostly the well-formed value, one draw in eight anything at all."""
    return st.sampled_from(range(8)).flatmap(lambda i: junk if i == 7 else strategy)

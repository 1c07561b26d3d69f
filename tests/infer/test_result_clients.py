"""Every result names a client the same way (``Result._client_index``): by name or index."""

from __future__ import annotations

import numpy as np
import pytest

from fedppl.infer.base import Result


def _result():
    return Result(history={"round": np.arange(1)}, client_names=("a", "b", "c"))


def test_a_client_is_a_name_or_an_index():
    r = _result()
    assert r._client_index("b", 3) == 1
    assert r._client_index(2, 3) == 2
    assert r._client_index(np.int64(0), 3) == 0


@pytest.mark.parametrize("client, error, match", [
    ("z", KeyError, "no client named 'z'"),
    (3, IndexError, "client 3 out of range for 3 clients"),
    (-1, IndexError, "out of range"),
    (1.0, TypeError, "index or a name"),
    (True, TypeError, "index or a name")])
def test_a_client_that_is_not_there_is_refused_by_name(client, error, match):
    with pytest.raises(error, match=match):
        _result()._client_index(client, 3)

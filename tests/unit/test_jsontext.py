"""jsontext.pieces is json.dumps in bounded pieces: the same text for the same
options, whatever the value (flask_solidloop/jsontext.py)."""

from __future__ import annotations

import datetime
import json
import random

import pytest

from flask_solidloop.jsontext import NotJsonTypeError, NotJsonValueError, pieces

OPTIONS = [{}, {"separators": (",", ":")}, {"separators": (",", ":"), "sort_keys": True}]


def value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 3 or roll < 0.35:
        return rng.choice([
            "".join(rng.choice('ab"\\\n\t\x01é✓\ud800\u2028') for _ in range(rng.randrange(12))),
            rng.randrange(-10**20, 10**20), 0.1, -2.5e-300, 1e308, float("nan"),
            float("-inf"), True, False, None, "é\"q" * 3000])
    if roll < 0.7:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "b", "é", 1, 2.5, True, None]): value(rng, depth + 1)
            for _ in range(rng.randrange(4))}


@pytest.mark.parametrize("options", OPTIONS)
def test_the_pieces_are_json_dumps_text(options):
    rng = random.Random(7)
    for _ in range(500):
        item = value(rng)
        try:
            expected = json.dumps(item, ensure_ascii=False, **options)
        except TypeError:  # mixed key types cannot be sorted: both refuse
            with pytest.raises(TypeError):
                "".join(pieces(item, chunk=5, **options))
            continue
        assert "".join(pieces(item, chunk=5, **options)) == expected


def test_long_strings_come_in_chunks():
    text = "x" * 200_000
    assert max(len(piece) for piece in pieces({"t": text}, chunk=1000)) <= 1000
    assert "".join(pieces({"t": text}, chunk=1000)) == json.dumps({"t": text})


def test_what_json_refuses_is_refused_with_its_errors():
    with pytest.raises(NotJsonTypeError, match="date is not JSON serializable"):
        "".join(pieces({"d": datetime.date(2026, 1, 1)}))
    assert "".join(pieces({"d": datetime.date(2026, 1, 1)}, default=str)) == \
        '{"d": "2026-01-01"}'
    with pytest.raises(ValueError, match="not JSON compliant"):
        "".join(pieces(float("nan"), allow_nan=False))
    loop: list = []
    loop.append(loop)
    with pytest.raises(NotJsonValueError, match="Circular"):
        "".join(pieces(loop))

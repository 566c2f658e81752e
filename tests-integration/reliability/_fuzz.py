"""Strategies of bad values and the check that a bad input is refused cleanly (shared by test_bad_input*)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def _package_errors() -> tuple[type[BaseException], ...]:
    from tidal_arena import ArenaError
    from tidal_hf import TidalHFError
    from tidal_kv import KVCacheError
    from tidal_plan import PlanError
    from tidal_quant import QuantError
    from tidal_stream import StreamError, StreamingError

    return (ArenaError, TidalHFError, KVCacheError, PlanError, QuantError, StreamError, StreamingError)


#: The exception types a refused input may raise: ValueError, TypeError or a tidal package's error class.
ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, *_package_errors())

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.filter_too_much,
        HealthCheck.too_slow,
    ],
)


def fuzz(n: int):
    """Hypothesis settings: ``n`` examples, deterministic, no deadline."""
    return settings(FUZZ, max_examples=n)


def refused(
    call: Callable[[], object], option: str, errors: tuple = (), match: str | None = None
) -> BaseException:
    """Run ``call``; it must raise one of ``ERRORS + errors`` whose message names ``option``.

    Returns the exception. Fails the test when the input is accepted or another exception type escapes.
    """
    try:
        call()
    except (*ERRORS, *errors) as e:
        text = str(e)
        want = match or re.escape(option)
        assert re.search(want, text, re.IGNORECASE), (
            f"error does not name {want!r}: {type(e).__name__}: {text}"
        )
        return e
    except Exception as e:  # the wrong exception type: a crash deep inside
        pytest.fail(
            f"{option}: {type(e).__name__} escaped instead of a ValueError/TypeError/package error: {e}"
        )
    pytest.fail(f"{option}: the bad input was accepted")
    raise AssertionError  # unreachable


_JUNK_OBJECTS = st.sampled_from([object(), {"a": 1}, {1, 2}, b"bytes", 1j, Ellipsis])
floats_any = st.floats(allow_nan=True, allow_infinity=True)
non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
junk_text = st.text(alphabet="abcxyz _-!#", max_size=8)


def bad_bool() -> st.SearchStrategy:
    """Anything but a bool."""
    return st.one_of(
        st.integers(), floats_any, junk_text, st.none(), st.lists(st.booleans(), max_size=2), _JUNK_OBJECTS
    )


def bad_pos_int(none_ok: bool = True, minimum: int = 1) -> st.SearchStrategy:
    """Ints below ``minimum``, floats, strings, bools, junk (and None unless allowed)."""
    parts = [
        st.integers(max_value=minimum - 1),
        floats_any,
        st.text(max_size=4),
        st.booleans(),
        _JUNK_OBJECTS,
    ]
    if not none_ok:
        parts.append(st.none())
    return st.one_of(*parts)


def bad_bytes(zero_ok: bool = False) -> st.SearchStrategy:
    """Byte counts no parser should accept: negative (or zero) ints, floats, bools, unit-less junk strings."""
    return st.one_of(
        st.integers(max_value=-1 if zero_ok else 0),
        floats_any,
        st.booleans(),
        junk_text,
        st.sampled_from(["-1GiB", "12XB", "1.5.2GB", "GiB", "nanGB", "infGiB", "-0.5 MiB", "24 gigs"]),
        st.lists(st.integers(), min_size=1, max_size=2),
        _JUNK_OBJECTS,
    )


def bad_fraction(list_ok: bool) -> st.SearchStrategy:
    """Not "auto" / a bool / a fraction in [0, 1] (/ a list of non-negative block indices)."""
    parts = [
        st.floats(min_value=1.0, exclude_min=True, allow_infinity=True),
        st.floats(max_value=0.0, exclude_max=True, allow_infinity=True),
        non_finite,
        junk_text.filter(lambda s: s != "auto"),
        st.none(),
        _JUNK_OBJECTS,
    ]
    if list_ok:
        parts.append(
            st.lists(
                st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=2)), min_size=1, max_size=3
            )
        )
    else:
        parts.append(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=3))
    return st.one_of(*parts)


def bad_choice(accepted: tuple) -> st.SearchStrategy:
    """Strings, numbers, None and junk not in ``accepted``."""
    return st.one_of(st.text(max_size=8), st.integers(), floats_any, st.none(), _JUNK_OBJECTS).filter(
        lambda v: not any(v is a or (type(v) is type(a) and v == a) for a in accepted)
    )

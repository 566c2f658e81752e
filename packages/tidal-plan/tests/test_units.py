import pytest

from tidal_plan import PlanConfigError, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (123, 123),
        ("24GiB", 24 * 1024**3),
        ("512MB", 512 * 10**6),
        ("1.5 GiB", int(1.5 * 1024**3)),
        ("64G", 64 * 1024**3),
        ("7", 7),
        ("2tb", 2 * 10**12),
        ("3 KiB", 3072),
    ],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("bad", ["24 parsecs", "", "GiB", -1, 1.5, True, None, "-3GiB"])
def test_parse_bytes_errors_name_the_option(bad):
    with pytest.raises(PlanConfigError, match="vram_budget=") as e:
        parse_bytes(bad, option="vram_budget")
    assert "24GiB" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_format_bytes():
    assert format_bytes(24 * 1024**3) == "24.0 GiB"
    assert format_bytes(1536 * 1024**2) == "1.5 GiB"
    assert format_bytes(100) == "100 B"

import pytest

from jobgen.base.durations import DurationError, format_human, format_slurm, parse_duration, parse_slurm_limit


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90s", 90),
        ("10m", 600),
        ("2h", 7200),
        ("1h30m", 5400),
        ("2d", 172800),
        ("1d2h3m4s", 93784),
        ("05:00", 300),  # Slurm MM:SS
        ("20:00:00", 72000),
        ("2-00:00:00", 172800),
        ("1-12", 129600),  # Slurm D-HH
        ("1-12:30", 131400),  # Slurm D-HH:MM
        (" 4H ", 14400),
    ],
)
def test_parse_accepts_slurm_and_human_syntax(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["30", 30, 1.5, True, "", "abc", "10 minutes", "1:60:00", "00:99", "-5m", "5ms"])
def test_parse_refuses_ambiguous_or_malformed(bad):
    with pytest.raises(DurationError):
        parse_duration(bad)


def test_bare_number_error_suggests_units():
    with pytest.raises(DurationError, match="'30m' or '30s'"):
        parse_duration("30")


@pytest.mark.parametrize(
    "seconds, slurm", [(0, "00:00:00"), (59, "00:00:59"), (3600, "01:00:00"), (93784, "1-02:03:04")]
)
def test_format_slurm_round_trips(seconds, slurm):
    assert format_slurm(seconds) == slurm
    assert parse_duration(slurm) == seconds


def test_format_human_round_trips():
    for seconds in (1, 60, 61, 3600, 5400, 86400, 93784):
        assert parse_duration(format_human(seconds)) == seconds


def test_slurm_limits():
    assert parse_slurm_limit("UNLIMITED") is None
    assert parse_slurm_limit("INFINITE") is None
    assert parse_slurm_limit("1-00:00:00") == 86400
    assert parse_slurm_limit("00:05:00") == 300

"""``bench.frontend``'s figures on a drifting machine: every ratio is taken within a round (the
two servers ran minutes apart at most) and the printed figure is the median of the rounds'
ratios, each round's shown beside it, with the target's verdict on that median."""

from __future__ import annotations

from bench.frontend import Result, merged, ratios, round_ratios


def _result(server: str, load: str, round_: int, rps: float, p99: float = 10.0) -> Result:
    return Result(
        server=server,
        load=load,
        texts_per_request=1,
        requests_per_s=rps,
        texts_per_s=rps,
        p50_ms=p99 / 2,
        p99_ms=p99,
        failed=0,
        cpu_us_per_request=1e6 / rps,
        loop_cpu_us_per_request=0.5e6 / rps,
        round=round_,
    )


def test_ratios_are_per_round_and_the_figure_is_their_median() -> None:
    # The machine slows down by half in round 2: both servers alike, so the ratio holds.
    results = [
        _result("embedding-server", "1-text", 0, 700),
        _result("ceiling", "1-text", 0, 1000),
        _result("embedding-server", "1-text", 1, 350),
        _result("ceiling", "1-text", 1, 500),
        _result("embedding-server", "1-text", 2, 500),
        _result("ceiling", "1-text", 2, 1000),
    ]
    assert round_ratios(results, "embedding-server", "ceiling", "1-text") == [0.7, 0.7, 0.5]
    lines = ratios(results)
    assert lines[0].startswith(
        "1-text: embedding-server / ceiling = 0.70x requests/s (median of rounds: 0.70, 0.70, "
        "0.50) (target >= 0.6x: met)"
    )
    # Across rounds (ours in round 1 against the ceiling in round 2) it would read 0.35x.
    ours = merged(results, "embedding-server", "1-text")
    assert ours is not None and ours.requests_per_s == 500


def test_a_round_missing_one_side_is_left_out_and_a_low_median_misses() -> None:
    results = [
        _result("embedding-server", "32-text", 0, 40),
        _result("ceiling", "32-text", 0, 100),
        _result("embedding-server", "32-text", 1, 90),  # its ceiling run is missing
        _result("embedding-server", "32-text", 2, 50),
        _result("ceiling", "32-text", 2, 100),
    ]
    assert round_ratios(results, "embedding-server", "ceiling", "32-text") == [0.4, 0.5]
    line = ratios(results)[0]
    assert "= 0.45x requests/s (median of rounds: 0.40, 0.50)" in line
    assert "(target >= 0.6x: MISSED)" in line

"""Tests for the tables of `make bench` that are not timings: bench.bubble_table() runs
every schedule, and its peak stash per stage must be what each schedule promises: m for
GPipe, min(p - s, m) for 1F1B, min(p, m) for ZB-H1, and for interleaved (micro-batches
times chunks) one more than its warm-up. No timing is asserted, only that the measured
numbers are shares of a step and times of an F, B and W."""
import bench


def test_bubble_table_peak_stash_per_stage():
    stages, micro_batches = (2, 4), (4, 8)
    table = bench.bubble_table(stages, micro_batches, dim=8, rows=2, steps=1, timeout_s=15)
    schedules = ("gpipe", "1f1b", "zb-h1", "interleaved", "dualpipev")   # DualPipeV from m = 2p
    assert sorted((r["p"], r["m"], r["schedule"]) for r in table) == sorted(
        (p, m, schedule) for p in stages for m in micro_batches for schedule in schedules
        if schedule != "dualpipev" or m >= 2 * p)
    for r in table:
        p, m = r["p"], r["m"]
        want = {"gpipe": [m] * p, "1f1b": [min(p - s, m) for s in range(p)], "zb-h1": [min(p, m)] * p,
                "interleaved": [min(2 * (p - s - 1) + p + 1, 2 * m) if m > p else 2 * m for s in range(p)],
                "dualpipev": [2 * p + 1] * p}
        assert r["peak_stash"] == want[r["schedule"]] == [bench.peak_bound(r["schedule"], p, s, m) for s in range(p)], r
        assert 0.0 <= r["bubble"] < 1.0 and r["step_ms"] > 0.0
        t_f, t_b, t_w = r["times"]
        assert t_f > 0 and t_b > 0 and (t_w > 0) == (r["schedule"] in ("zb-h1", "dualpipev")), r

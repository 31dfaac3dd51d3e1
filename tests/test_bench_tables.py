"""Tests for the tables of `make bench` that are not timings: bench.bubble_table() runs
both schedules, and its peak stash per stage must be what each schedule promises: m for GPipe, min(p - s, m) for 1F1B. No timing is asserted, only
that the measured numbers are shares of a step."""
import bench


def test_bubble_table_peak_stash_per_stage():
    stages, micro_batches = (2, 4), (1, 3, 6)
    table = bench.bubble_table(stages, micro_batches, dim=8, rows=2, steps=1, timeout_s=15)
    assert sorted((r["p"], r["m"], r["schedule"]) for r in table) == sorted(
        (p, m, schedule) for p in stages for m in micro_batches for schedule in ("gpipe", "1f1b"))
    for r in table:
        p, m = r["p"], r["m"]
        want = [m] * p if r["schedule"] == "gpipe" else [min(p - s, m) for s in range(p)]
        assert r["peak_stash"] == want, r
        assert 0.0 <= r["bubble"] < 1.0 and r["step_ms"] > 0.0

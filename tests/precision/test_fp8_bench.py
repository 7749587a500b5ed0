"""bench/fp8_compare.py's arithmetic: the loss bound is checked at every common log point after step 50."""

from bench.fp8_compare import loss_difference, speed_ratios


def test_loss_difference_is_relative_to_bf16_at_common_log_points_after_the_bound():
    bf16 = [{"iteration": i, "lm_loss": loss} for i, loss in ((10, 8.0), (50, 4.0), (60, 3.0), (70, 2.0))]
    fp8 = [{"iteration": i, "lm_loss": loss} for i, loss in ((10, 9.0), (50, 4.4), (60, 3.03), (70, 2.01), (80, 1.0))]
    result = loss_difference(bf16, fp8, after=50)
    assert result["log_points"] == [10, 50, 60, 70]
    assert abs(result["max_relative_difference_after"] - 0.01) < 1e-12  # steps 60 (1%) and 70 (0.5%) only
    assert result["final"] == {"bf16": 2.0, "fp8": 2.01}


def test_speed_ratios_need_both_summaries():
    assert speed_ratios({"summary": None}, {"summary": {"tokens_per_s": 1}}) is None
    ratios = speed_ratios({"summary": {"tokens_per_s": 100.0, "mfu": 0.5, "mem_gib": 80}},
                          {"summary": {"tokens_per_s": 120.0, "mfu": 0.6, "mem_gib": 60}})
    assert abs(ratios["tokens_per_s"] - 1.2) < 1e-12 and ratios["mem_gib"] == {"bf16": 80, "fp8": 60}

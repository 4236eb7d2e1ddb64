"""``speccache precompute`` and ``speccache estimate``: a Hugging Face target over chat data, into a cache."""

from speccache.precompute.run import PrecomputeConfig, make_plan, run_precompute, summary_line

__all__ = ["PrecomputeConfig", "make_plan", "run_precompute", "summary_line"]

"""``speccache precompute`` and ``speccache estimate``: a Hugging Face target over chat data, into a cache."""

from speccache.precompute.config import PrecomputeConfig
from speccache.precompute.report import summary_line
from speccache.precompute.run import make_plan, run_precompute

__all__ = ["PrecomputeConfig", "make_plan", "run_precompute", "summary_line"]

"""The name ``speccache.regenerate``: the Python API of ``speccache regenerate``, whose home is
:mod:`speccache.precompute.regenerate` (docs/data.md, "Regenerating answers").

    from speccache.regenerate import RegenerateConfig, regenerate

    result = regenerate(RegenerateConfig(model="TARGET", data="chat.jsonl", out="DIR", max_new_tokens=512))
"""

from speccache.precompute.regenerate import RegenerateConfig, RegenerateResult, regenerate

__all__ = ["RegenerateConfig", "RegenerateResult", "regenerate"]

"""Helpers the test modules share: ``from support import cachecmp`` (tests/ is on ``sys.path`` beside its conftest).

``cachecmp`` compares caches, ``crashlib`` kills producers through a fork server, ``follow_trainer`` is the
trainer a fork server runs, ``residency`` reads what this process has mapped in memory.
"""

from __future__ import annotations

import os

SOAK = os.environ.get("SPECCACHE_SOAK", "") not in ("", "0")
"""``SPECCACHE_SOAK=1`` (``make soak``): ``soak`` tests run instead of skipping, and suites that scale their work by
it (kill points, examples, trials) run more of it."""

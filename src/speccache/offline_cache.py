"""``speccache.offline_cache``: the NeMo AutoModel-compatible offline-cache module.

This name is :mod:`speccache.compat.offline_cache` itself (one module object, so that
patching an attribute here patches what its functions call).
"""

import sys

from speccache.compat import offline_cache as _module

sys.modules[__name__] = _module

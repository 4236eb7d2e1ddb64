"""Everything that exists only for the NeMo AutoModel-compatible API (:mod:`speccache.offline_cache`)."""

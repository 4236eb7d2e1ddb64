"""Speculative methods: each owns its schema, its feature computation, its side files and its trainer-facing reader;
its part in ``precompute`` is an object of the :class:`.base.Method` protocol, named in :mod:`.registry`."""

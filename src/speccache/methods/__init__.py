"""Speculative methods: each owns its schema, its feature computation, its side files and its trainer-facing reader."""

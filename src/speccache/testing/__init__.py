"""Test support shipped with the package (never imported by it): a model-free producer and fault injection."""

"""``--method``: each name it accepts and the method that answers to it (:class:`speccache.methods.base.Method`)."""

from __future__ import annotations

from speccache.errors import UsageError
from speccache.methods.base import Method
from speccache.methods.eagle3_producer import EAGLE3
from speccache.methods.layers_producer import LAYERS

__all__ = ["DEFAULT_METHOD", "METHODS", "method_for"]

METHODS: dict[str, Method] = {name: method for method in (EAGLE3, LAYERS) for name in method.presets}
"""``--method`` name -> method, in the order ``--help`` lists them. A new method is a module of this room and an
entry here."""

DEFAULT_METHOD = "eagle3"
"""What ``--method`` runs when it is not given."""


def method_for(name: str) -> Method:
    """The method ``--method name`` runs.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if name not in METHODS:
        raise UsageError(f"--method {name!r} is unknown; choose one of {', '.join(METHODS)}")
    return METHODS[name]

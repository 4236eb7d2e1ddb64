"""A reference EAGLE-3 draft, its trainer and its evaluator, reading caches through speccache's public readers."""

"""``PrecomputeConfig`` is the one home of each setting's default: the ``precompute`` and ``estimate`` flags take
the fields' defaults, and ``from_args`` fills every field from its flag."""

from __future__ import annotations

from dataclasses import fields

import pytest

from speccache.cli import build_parser
from speccache.demo import demo_data_path
from speccache.precompute import PrecomputeConfig

DATA = demo_data_path("sharegpt")


def _settings(cfg: PrecomputeConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init and f.name != "argv"}


@pytest.mark.parametrize("command", ["precompute", "estimate"])
def test_the_flags_default_to_the_config_fields(tiny_models, tmp_path, command):
    model = tiny_models("llama")
    out = ["--out", str(tmp_path / "c")] if command == "precompute" else []
    cfg = PrecomputeConfig.from_args(build_parser().parse_args([command, "--model", model, "--data", DATA, *out]))
    by_hand = PrecomputeConfig(model=model, data=DATA, out=str(tmp_path / "c") if out else "")
    by_hand.check()
    assert _settings(cfg) == _settings(by_hand)


def test_every_field_is_read_from_its_flag(tiny_models, tmp_path):
    """A value unlike the default on every flag reaches its field (parsed where the flag is text)."""
    model = tiny_models("llama")
    argv = ["precompute", "--model", model, "--data", DATA, "--out", str(tmp_path / "c"), "--max-length", "64"]
    argv += ["--batch-size", "2", "--shard-size", "4", "--aux-layers", "1,2,3", "--encode", "aux_hidden_states=fp8"]
    argv += ["--max-cache-bytes", "2K", "--timeout", "7", "--turns", "last", "--batching", "ordered"]
    cfg = PrecomputeConfig.from_args(build_parser().parse_args(argv))
    assert (cfg.max_length, cfg.batch_size, cfg.shard_size, cfg.aux_layers) == (64, 2, 4, [1, 2, 3])
    assert cfg.encodings == {"aux_hidden_states": "fp8"} and cfg.max_cache_bytes == 2048
    assert (cfg.timeout, cfg.turns, cfg.batching) == (7.0, "last", "ordered")


def test_every_field_has_a_precompute_flag():
    """from_args reads fields by their flags' names: a field without a flag would keep its default silently."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    dests = {a.dest for a in sub.choices["precompute"]._actions}
    flagged = {f.name for f in fields(PrecomputeConfig) if f.init and f.metadata.get("flag") is None}
    assert flagged - dests == {"argv"}  # the command line itself, which the CLI records
    assert "encode" in dests  # --encode fills encodings

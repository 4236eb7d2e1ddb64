"""A reader loads no producer code: ``import speccache`` and the trainer-facing readers leave ``speccache.write``,
``speccache.data`` and ``speccache.precompute`` unimported, while ``CacheWriter`` stays one import away."""

from __future__ import annotations

import subprocess
import sys

import pytest

PRODUCERS = ("speccache.write", "speccache.data", "speccache.precompute")

READERS = {
    "top-level": "import speccache\nfrom speccache import CacheDataset, Eagle3CacheDataset, build_eagle3_dataloader, "
    "TargetHead, PadCollator, LocalityShuffleSampler, verify_cache, Follow",
    "eagle3 reader": "from speccache.methods.eagle3 import Eagle3CacheDataset, TargetHead, draft_view, "
    "row_position_mask, read_side_file",
    "layers reader": "from speccache.methods.layers import LayerFeatureDataset, build_layer_dataloader, "
    "dspark_dataset, dflash_dataset, mtp_dataset, eagle3_dataset",
}


def loaded_after(code: str) -> list[str]:
    """The speccache modules a fresh interpreter holds after running ``code``."""
    report = "\nimport sys\nprint(' '.join(sorted(m for m in sys.modules if m.startswith('speccache'))))"
    out = subprocess.run([sys.executable, "-c", code + report], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("code", READERS.values(), ids=READERS.keys())
def test_a_reader_loads_no_producer_code(code):
    loaded = loaded_after(code)
    assert "speccache.read" in loaded  # the probe ran: the reader itself is there
    producers = [m for m in loaded if m in PRODUCERS or m.startswith(tuple(p + "." for p in PRODUCERS))]
    assert producers == [], producers


def test_cache_writer_is_imported_on_first_use():
    code = (
        "import sys, speccache\n"
        "assert 'speccache.write' not in sys.modules\n"
        "from speccache import CacheWriter\n"
        "from speccache.write import CacheWriter as home\n"
        "assert CacheWriter is home and speccache.CacheWriter is home and 'CacheWriter' in speccache.__all__\n"
    )
    assert "speccache.write" in loaded_after(code)


def test_an_unknown_top_level_name_is_still_an_attribute_error():
    import speccache

    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        speccache.NoSuchName  # noqa: B018

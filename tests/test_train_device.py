"""``speccache train --device``: an unusable device is refused by name before the cache is read or a draft is
written (the CLI prints the error, no traceback)."""

from __future__ import annotations

import pytest
import torch

from speccache.cli import main


@pytest.mark.parametrize(
    "device, message",
    [
        ("tpu", "--device 'tpu' is unknown; choose cpu or cuda"),
        pytest.param(
            "cuda",
            "--device cuda: no CUDA device is visible to this process; use --device cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
        ),
    ],
)
def test_an_unusable_device_is_refused_by_name(tmp_path, capsys, device, message):
    out = tmp_path / "draft"
    code = main(["train", str(tmp_path / "no-cache"), "--out", str(out), "--device", device])
    assert code != 0
    err = capsys.readouterr().err
    assert f"speccache train: error: {message}" in err and "Traceback" not in err
    assert not out.exists()

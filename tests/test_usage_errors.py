"""Exit codes of the command line: 2 for a refused flag (:class:`UsageError`), 1 for every other error, each as one
line without a traceback; and the settings a Python caller builds by hand meet the refusals the CLI's do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import speccache.precompute.config as config_module
import speccache.precompute.run as run_module
from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.errors import CacheFormatError, UsageError
from speccache.precompute import PrecomputeConfig, run_precompute
from speccache.precompute.estimate import estimate_cache
from speccache.precompute.regenerate import RegenerateConfig, regenerate
from speccache.testing.synthetic import write_synthetic_cache

ROOT = Path(__file__).resolve().parents[1]
DATA = demo_data_path("sharegpt")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("usage") / "cache")
    write_synthetic_cache(out, num_samples=8, shard_size=4, hidden=8, max_len=8, overlap=False)
    return out


def _speccache(*argv: str, patch: str = "") -> subprocess.CompletedProcess:
    """``speccache ARGV`` in a fresh interpreter (after ``patch``, Python run first), as a user runs it."""
    code = f"import sys\n{patch}\nfrom speccache.cli import main\nsys.exit(main({list(argv)!r}))\n"
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_a_bad_flag_exits_2_and_a_library_error_1_each_in_one_line(cache, tmp_path):
    bad = _speccache("export", "--to", "specforge", cache, str(tmp_path / "a"), "--layers", "1,x")
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.splitlines() == [
        "speccache export: error: --layers '1,x' must be comma-separated integers, e.g. 1,15,28"
    ]
    assert not (tmp_path / "a").exists()
    # a ValueError that no flag caused (a library's, or a bug's): the command failed, the usage was fine
    patch = (
        "import speccache.compat.commands as m\n"
        "def refuse(*args, **kwargs):\n"
        "    raise ValueError('the library refused')\n"
        "m.export_peer = refuse"
    )
    failed = _speccache("export", "--to", "specforge", cache, str(tmp_path / "b"), patch=patch)
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr.splitlines() == ["speccache export: error: the library refused"]


@pytest.mark.parametrize("to", ["specforge", "speculators", "nemo-eagle3"])
def test_export_layers_that_are_not_integers_name_the_flag(cache, tmp_path, capsys, to):
    assert main(["export", "--to", to, cache, str(tmp_path / "out"), "--layers", "1,x"]) == 2
    assert "--layers '1,x' must be comma-separated integers" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_import_layers_that_are_not_integers_name_the_flag(tiny_models, tmp_path, capsys):
    (tmp_path / "src").mkdir()
    argv = ["import", "--from", "speculators", str(tmp_path / "src"), str(tmp_path / "out")]
    assert main([*argv, "--model", tiny_models("llama"), "--layers", "[1, two]"]) == 2
    assert "--layers '[1, two]' must be comma-separated integers" in capsys.readouterr().err


def test_a_speccache_error_that_is_no_usage_exits_1(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text("{")
    # precompute --out DIR --resume alone reads DIR's manifest for the command to rerun: damaged, not misused
    assert main(["precompute", "--out", str(tmp_path / "c"), "--resume"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("speccache precompute: error: ") and "is not valid JSON" in err
    assert main(["precompute", "--out", str(tmp_path / "new"), "--resume"]) == 2  # the flags are what is wrong


def test_usage_error_is_still_a_value_error_for_python_callers():
    from speccache.methods.layers import parse_layer_ids

    with pytest.raises(ValueError, match="--aux-layers 'a' must be comma-separated integers") as raised:
        parse_layer_ids("a", "--aux-layers")
    assert isinstance(raised.value, UsageError) and not isinstance(raised.value, CacheFormatError)


BAD_SETTINGS = [
    ({"batch_size": 0}, ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ({"shard_size": 6, "batch_size": 4}, ["--shard-size", "6", "--batch-size", "4"], "must be a positive multiple"),
    ({"method": "medusa"}, ["--method", "medusa"], "--method 'medusa' is unknown"),
    ({"shard_target": "fsdp"}, ["--shard-target", "fsdp"], "--shard-target fsdp runs under torchrun"),
    ({"layers": [1]}, ["--layers", "1"], "--method eagle3 takes --aux-layers"),
]


@pytest.mark.parametrize("settings, flags, message", BAD_SETTINGS, ids=[m for _, _, m in BAD_SETTINGS])
def test_run_precompute_refuses_a_config_built_by_hand_as_the_cli_does(
    tiny_models, tmp_path, capsys, monkeypatch, settings, flags, message
):
    model, out = tiny_models("llama"), tmp_path / "out"
    monkeypatch.setattr(run_module, "make_plan", lambda *a: pytest.fail("planned with unchecked settings"))
    assert main(["precompute", "--model", model, "--data", DATA, "--out", str(out), "--quiet", *flags]) == 2
    cli_message = capsys.readouterr().err.strip().removeprefix("speccache precompute: error: ")
    assert message in cli_message
    with pytest.raises(UsageError) as raised:
        run_precompute(PrecomputeConfig(model=model, data=DATA, out=str(out), **settings), progress=False)
    assert str(raised.value) == cli_message
    assert not out.exists()


@pytest.mark.parametrize("settings, message", [(s, m) for s, _, m in BAD_SETTINGS if "torchrun" not in m])
def test_estimate_refuses_a_config_built_by_hand(tiny_models, monkeypatch, settings, message):
    """An estimate plans the run precompute would make (of any world size: a sharded target is estimated too)."""
    monkeypatch.setattr(run_module, "make_plan", lambda *a: pytest.fail("planned with unchecked settings"))
    with pytest.raises(UsageError, match=message):
        estimate_cache(PrecomputeConfig(model=tiny_models("llama"), data=DATA, out="", **settings))


def test_the_cli_checks_the_settings_once(tiny_models, tmp_path, monkeypatch):
    """The model check may ask the hub: from_args checks, and run_precompute does not check the same settings
    again; a setting changed after a check is checked again."""
    probes: list[str] = []
    real = config_module.check_model_source
    monkeypatch.setattr(config_module, "check_model_source", lambda model: (probes.append(model), real(model))[1])

    class Planned(Exception):
        pass

    def planned(*args):
        raise Planned

    monkeypatch.setattr(run_module, "make_plan", planned)
    argv = ["precompute", "--model", tiny_models("llama"), "--data", DATA, "--out", str(tmp_path / "o"), "--quiet"]
    with pytest.raises(Planned):
        main(argv)
    assert probes == [tiny_models("llama")]
    cfg = PrecomputeConfig(model=tiny_models("llama"), data=DATA, out="")
    cfg.check()
    cfg.check()
    assert len(probes) == 2
    cfg.batch_size = 0
    with pytest.raises(UsageError, match="--batch-size must be >= 1"):
        cfg.check()


def test_regenerate_refuses_a_config_built_by_hand_with_the_same_verb(tmp_path):
    config = RegenerateConfig("m", "d", str(tmp_path / "out"), top_p=0.0)
    with pytest.raises(UsageError, match=r"--top-p must lie in \(0, 1\], got 0.0"):
        config.check()
    with pytest.raises(UsageError, match=r"--top-p must lie in \(0, 1\], got 0.0"):
        regenerate(config)
    assert not (tmp_path / "out").exists()


def test_a_view_weight_that_is_no_number_is_bad_usage(cache, tmp_path, capsys):
    assert main(["merge", cache, cache, "--out", str(tmp_path / "v"), "--weights", "2,x"]) == 2
    assert "--weights '2,x' must be comma-separated numbers" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "CACHE", "--out", "OUT", "--follow", "--replay", "0"], "replay must be an integer >= 1"),
        (["train", "CACHE", "--out", "OUT", "--follow", "--follow-timeout", "0"], "timeout and poll must be positive"),
        (["merge", "CACHE", "CACHE", "--out", "OUT", "--weights", "1"], "must give one weight per cache (2)"),
    ],
)
def test_flags_the_api_refuses_are_bad_usage(cache, tmp_path, capsys, argv, message):
    """Flags passed through to an API object (Follow, make_merge_view) without a check of their own."""
    out = tmp_path / "out"
    assert main([{"CACHE": cache, "OUT": str(out)}.get(a, a) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()

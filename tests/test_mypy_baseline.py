"""tools/mypy_baseline.py, the type check of `make lint`: mypy's errors are held to a baseline that only shrinks.

mypy itself is replaced by canned output (a real run takes half a minute); what is pinned is how its lines are
read and compared.
"""

from __future__ import annotations

import subprocess

import pytest

from support import load_tool

OLD = 'src/speccache/a.py:12: error: Incompatible types in assignment (expression has type "str")  [assignment]'
NEW = 'src/speccache/b.py:7: error: Name "x" is not defined  [name-defined]'
OLD_ENTRY = 'src/speccache/a.py:assignment:Incompatible types in assignment (expression has type "str")'


@pytest.fixture()
def tool():
    return load_tool("mypy_baseline")


def fake_mypy(monkeypatch, tool, *lines: str, returncode: int = 1) -> None:
    stdout = "".join(f"{line}\n" for line in lines)
    done = subprocess.CompletedProcess([], returncode, stdout=stdout, stderr="")
    monkeypatch.setattr(tool.subprocess, "run", lambda *a, **k: done)


def test_errors_in_the_baseline_pass_whatever_their_line(monkeypatch, tool, tmp_path, capsys):
    baseline = tmp_path / "baseline.txt"
    baseline.write_text(f"# comment\n{OLD_ENTRY}\n", encoding="utf-8")
    fake_mypy(monkeypatch, tool, OLD.replace(":12:", ":99:"), "src/speccache/a.py:99: note: a note")
    assert tool.main(["--baseline", str(baseline)]) == 0
    assert "1 errors, all in the baseline" in capsys.readouterr().out


def test_a_new_error_fails(monkeypatch, tool, tmp_path, capsys):
    baseline = tmp_path / "baseline.txt"
    baseline.write_text(f"{OLD_ENTRY}\n", encoding="utf-8")
    fake_mypy(monkeypatch, tool, OLD, NEW)
    assert tool.main(["--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert 'new mypy error (fix it; the baseline only shrinks): src/speccache/b.py:name-defined:Name "x"' in out
    assert NEW in out  # mypy's own line, with its line number


def test_a_second_copy_of_a_baselined_error_is_new(monkeypatch, tool, tmp_path):
    baseline = tmp_path / "baseline.txt"
    baseline.write_text(f"{OLD_ENTRY}\n", encoding="utf-8")
    fake_mypy(monkeypatch, tool, OLD, OLD.replace(":12:", ":40:"))
    assert tool.main(["--baseline", str(baseline)]) == 1


def test_a_fixed_error_must_leave_the_baseline(monkeypatch, tool, tmp_path, capsys):
    baseline = tmp_path / "baseline.txt"
    baseline.write_text(f"{OLD_ENTRY}\n", encoding="utf-8")
    fake_mypy(monkeypatch, tool, returncode=0)
    assert tool.main(["--baseline", str(baseline)]) == 1
    assert f"fixed, so delete this line from baseline.txt: {OLD_ENTRY}" in capsys.readouterr().out


def test_write_records_the_current_errors(monkeypatch, tool, tmp_path):
    baseline = tmp_path / "baseline.txt"
    fake_mypy(monkeypatch, tool, NEW, OLD)
    assert tool.main(["--baseline", str(baseline), "--write"]) == 0
    assert tool.main(["--baseline", str(baseline)]) == 0
    assert OLD_ENTRY in baseline.read_text(encoding="utf-8").splitlines()


def test_a_mypy_crash_is_not_a_pass(monkeypatch, tool, tmp_path):
    fake_mypy(monkeypatch, tool, returncode=2)
    with pytest.raises(SystemExit, match="mypy failed"):
        tool.main(["--baseline", str(tmp_path / "baseline.txt")])


def test_an_unreadable_error_line_is_not_skipped(monkeypatch, tool, tmp_path):
    fake_mypy(monkeypatch, tool, "src/speccache/a.py:3: error: a message without a code")
    with pytest.raises(SystemExit, match="cannot parse"):
        tool.main(["--baseline", str(tmp_path / "baseline.txt")])

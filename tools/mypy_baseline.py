"""Run mypy and hold its errors to the committed baseline, which may only shrink.

Each baseline line is ``file:error-code:message`` without the line number, so an edit elsewhere in a file does not
invalidate it; a line appears once per error it accepts. The run fails when mypy reports an error the baseline does
not hold (fix it), or when the baseline holds an error mypy no longer reports (delete that line).

Usage: python tools/mypy_baseline.py [--baseline PATH] [--write]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = ROOT / ".mypy-baseline.txt"
# mypy's error lines: "path:line: error: message  [code]"
ERROR = re.compile(r"^(?P<file>[^:]+):\d+: error: (?P<message>.*?)  \[(?P<code>[a-z-]+)\]$")


def run_mypy() -> tuple[Counter[str], str]:
    """Run mypy (configured in pyproject.toml) from the project root.

    Returns:
        The normalised errors, counted, and mypy's whole output.

    Raises:
        SystemExit: mypy crashed or printed an error line this script cannot parse.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-pretty", "--no-error-summary", "--hide-error-context"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode not in (0, 1):
        sys.exit(f"mypy failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    errors: Counter[str] = Counter()
    for line in proc.stdout.splitlines():
        if ": error: " not in line:
            continue
        match = ERROR.match(line)
        if match is None:
            sys.exit(f"tools/mypy_baseline.py cannot parse this mypy line; update its ERROR pattern:\n{line}")
        errors[f"{match['file']}:{match['code']}:{match['message']}"] += 1
    return errors, proc.stdout


def read_baseline(path: Path) -> Counter[str]:
    """The baseline's entries, counted (blank lines and ``#`` comments skipped)."""
    if not path.exists():
        return Counter()
    lines = path.read_text(encoding="utf-8").splitlines()
    return Counter(line for line in lines if line.strip() and not line.startswith("#"))


def main(argv: list[str] | None = None) -> int:
    """Compare mypy's errors with the baseline; 0 when they match, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    parser.add_argument("--write", action="store_true", help="replace the baseline with mypy's current errors")
    args = parser.parse_args(argv)
    errors, output = run_mypy()
    if args.write:
        header = "# mypy errors accepted for now (tools/mypy_baseline.py): this list may only shrink.\n"
        args.baseline.write_text(header + "".join(f"{e}\n" for e in sorted(errors.elements())), encoding="utf-8")
        print(f"wrote {sum(errors.values())} entries to {args.baseline}")
        return 0
    baseline = read_baseline(args.baseline)
    new = errors - baseline
    gone = baseline - errors
    for entry in sorted(new.elements()):
        print(f"new mypy error (fix it; the baseline only shrinks): {entry}")
    if new:
        print("mypy's own report of those files:")
        new_files = {entry.split(":", 1)[0] for entry in new}
        print("\n".join(line for line in output.splitlines() if line.split(":", 1)[0] in new_files))
    for entry in sorted(gone.elements()):
        print(f"fixed, so delete this line from {args.baseline.name}: {entry}")
    if new or gone:
        return 1
    print(f"mypy: {sum(errors.values())} errors, all in the baseline ({args.baseline.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

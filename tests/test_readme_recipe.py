"""The README's own-data recipe runs as written.

The ``bash`` block after the ``<!-- readme-recipe`` comment in README.md is what a newcomer copies. Every run of the
suite checks that it is still there and still holds the steps the README explains; ``SPECCACHE_SOAK=1``
(``make soak``) runs it with bash in an empty directory, against the demo's real target (SmolLM2-135M-Instruct),
with this interpreter's environment on PATH as ``. .venv/bin/activate`` gives a user: about 2.5 minutes on 2 cores.
The README's links are checked too: it is mostly a table of contents into docs/.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from speccache import verify_cache
from speccache.format.manifest import Manifest

pytestmark = pytest.mark.soak_suite  # `make soak` runs the whole module, its soak test and the others

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- readme-recipe"


def recipe_block(readme: str) -> str:
    """The body of the first ```bash block after the marker comment."""
    start = readme.find(MARKER)
    assert start >= 0, f"README.md has no {MARKER} comment marking the own-data recipe"
    match = re.compile(r"```bash\n(.*?)\n```", re.S).search(readme, start)
    assert match, "no ```bash block follows the readme-recipe marker in README.md"
    return match.group(1)


def test_recipe_block_is_found_and_holds_the_steps() -> None:
    block = recipe_block((ROOT / "README.md").read_text())
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    # "about ten lines": a recipe that grows past a screen is no longer one
    assert 5 <= len(commands) <= 12, block
    for step in (
        "speccache precompute",
        "--draft-vocab-from",
        "speccache train",
        "speccache evaluate",
        "speccache export",
    ):
        assert step in block, f"the README's recipe lost {step!r}"


def test_recipe_block_is_found_only_after_its_marker() -> None:
    readme = "```bash\nnot this\n```\n<!-- readme-recipe: x -->\ntext\n```bash\nthis one\n```\n```bash\nnor this\n```\n"
    assert recipe_block(readme) == "this one"
    with pytest.raises(AssertionError, match="no .* comment"):
        recipe_block("```bash\nls\n```\n")


@pytest.mark.timeout(1800)
@pytest.mark.soak(reason="a real 135M target on a CPU takes minutes")
def test_recipe_runs_as_written_on_the_real_target(tmp_path: Path) -> None:
    block = recipe_block((ROOT / "README.md").read_text())
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    # -e and pipefail: a step that fails fails the test here, not in the step after it
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"the README's recipe failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    for cache in ("ctrain", "ceval"):
        assert verify_cache(str(tmp_path / cache)).ok, f"{cache} is not a sound cache"
    train, heldout = Manifest.read(str(tmp_path / "ctrain")), Manifest.read(str(tmp_path / "ceval"))
    assert train.complete and heldout.complete
    assert (train.num_samples, heldout.num_samples) == (32, 8)
    assert heldout.config["draft_vocab_from"]["cache"] == str(tmp_path / "ctrain")

    assert (tmp_path / "draft" / "config.json").is_file()
    assert (tmp_path / "draft" / "model.safetensors").is_file()
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["teacher_forced"]) >= {"draft", "ngram", "prompt_lookup"}
    decoded = report["speculative"]
    assert decoded["prompts"] == 4
    for proposer in ("draft", "ngram", "prompt_lookup"):
        assert decoded[proposer]["identical_to_greedy"] is True, proposer
        assert decoded[proposer]["tau"] >= 1.0, proposer
    assert len(list((tmp_path / "ctrain-specforge").rglob("*.ckpt"))) == 32, "SpecForge's layout is one file per sample"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but '-' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_reach_files_and_headings() -> None:
    # the README is a table of contents now: a link to a moved or renamed section must fail here
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(targets) > 20, "the README's links were not found"
    for path, anchor in targets:
        if "://" in path:
            continue
        target = ROOT / path
        assert target.is_file(), f"README.md links {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"README.md links {path}#{anchor}: no such heading"

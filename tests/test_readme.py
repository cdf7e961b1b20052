"""Every shell command the README shows runs, as written, from a copy of the repository.

A new user's second command is the README's; it once failed for a month while every unit
test passed. So the commands are read from the README's ```bash blocks (not copied here)
and run in a copy of the tracked files, with `.venv` as the README has it, budgets and
paths as written, in the order shown (a later command may read an earlier one's file).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: `make test` is the command that runs this test: running it here would recurse.
NOT_RUN_HERE = {"make test": "it is the command that runs this test (CI runs it)"}


def readme_commands(text: str) -> list[str]:
    """The commands of every ```bash block, in order, comments and blank lines dropped,
    continued lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def test_the_readme_shows_its_setup_commands_first():
    commands = readme_commands(README.read_text())
    assert commands[:2] == ["make demo", "make test"]
    assert any(c.startswith(".venv/bin/automap plan") for c in commands)


def _copy_of_the_repository(dest: Path) -> Path:
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, tracked):
        source = ROOT / name.decode()
        if source.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)  # keeps mtimes: make sees .venv up to date
    (dest / ".venv").symlink_to(ROOT / ".venv")
    return dest


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path):
    venv = ROOT / ".venv"
    if not (venv / "bin" / "automap").exists():
        pytest.skip("the README's commands need the .venv that `make` creates")
    stamp, pyproject = venv / ".installed", ROOT / "pyproject.toml"
    # `make demo` would reinstall into the shared .venv from the copy if this were stale.
    assert stamp.exists() and stamp.stat().st_mtime >= pyproject.stat().st_mtime, (
        "run `make test` (it installs the package) before this test"
    )
    repo = _copy_of_the_repository(tmp_path / "repo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTHONPATH"] = str(repo / "src")  # the copy's sources, not the installed ones
    ran = []
    for command in readme_commands(README.read_text()):
        if command in NOT_RUN_HERE:
            continue
        done = subprocess.run(
            ["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, (
            f"README command failed (exit {done.returncode}): {command}\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
        ran.append(shlex.split(command)[0])
    assert len(ran) >= 5
    assert (repo / "plan.json").exists()


def test_no_command_is_skipped_without_a_reason():
    shown = set(readme_commands(README.read_text()))
    assert set(NOT_RUN_HERE) <= shown, "a skipped command no longer in the README"

"""The README's complete program runs as pasted and prints what the README quotes
(issue 23: "a complete program that runs as pasted")."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_readme_program_runs_as_pasted_and_prints_the_quoted_output(tmp_path):
    readme = (ROOT / "README.md").read_text()
    program = _blocks(readme, "python")[0]
    console = _blocks(readme, "console")[0].splitlines()
    command, expected = console[0], console[1:]
    name = program.splitlines()[0].lstrip("# ").strip()          # "# mlp_train.py"
    assert command == f"$ python {name}", (command, name)
    (tmp_path / name).write_text(program)
    done = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == expected, (done.stdout, expected)

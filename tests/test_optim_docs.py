"""docs/optim.md's complete program runs as pasted and prints what the page quotes:
one program for 50 scheduled steps, equal to one device, and the collectives it
names (one reduce-scatter of the accumulated gradients, one scalar for the norm)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_optim_page_program_runs_as_pasted(tmp_path):
    page = (ROOT / "docs" / "optim.md").read_text()
    program = _blocks(page, "python")[0]
    console = _blocks(page, "console")[0].splitlines()
    command, expected = console[0], console[1:]
    name = program.splitlines()[0].lstrip("# ").strip()
    assert command == f"$ python {name}", (command, name)
    (tmp_path / name).write_text(program)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == expected, (done.stdout, expected)

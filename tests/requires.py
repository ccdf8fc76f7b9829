"""Marks for tests that need what a machine may lack; each skips with its reason."""

from __future__ import annotations

import os
import shutil

import pytest


def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would run (``$CXX``, else ``g++``, as
    torch._inductor.cpp_builder looks for it), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


needs_cxx = pytest.mark.skipif(
    cxx_compiler() is None,
    reason=f"inductor compiles C++ for the CPU and no compiler was found "
           f"({os.environ.get('CXX', 'g++')!r} is not on PATH; install g++ or set CXX)",
)

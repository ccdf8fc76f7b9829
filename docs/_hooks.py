"""MkDocs hooks for the docs site (mkdocs.yml ``hooks:``); warnings fail ``--strict``.

- Links from a page to a file of the repository outside ``docs/`` (an example, a
  benchmark README) must point at a file that exists. They become links to the
  repository's source when ``repo_url`` is set in mkdocs.yml, else plain text.
- Every public object of the API reference has a docstring: each name in the
  ``__all__`` of the modules below that is a function or a class, and each public
  method and property of those classes (an override may inherit its base's docstring).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import sys

log = logging.getLogger("mkdocs.plugins.sharded_docs")

API_MODULES = [
    "sharded", "sharded.collectives", "sharded.random", "sharded.modes", "sharded.plans",
    "sharded.checkpoint", "sharded.optim", "sharded.pipelining", "sharded.precision",
    "sharded.rules",
    "transforms",
]

_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def on_config(config):
    root = os.path.dirname(config.config_file_path)
    if root not in sys.path:
        sys.path.insert(0, root)
    for problem in missing_docstrings():
        log.warning("missing docstring: %s", problem)
    return config


def missing_docstrings() -> list[str]:
    out = []
    for name in API_MODULES:
        mod = importlib.import_module(name)
        if not (mod.__doc__ or "").strip():
            out.append(f"module {name}")
        for attr in getattr(mod, "__all__", []):
            obj = getattr(mod, attr)
            if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
                continue
            where = f"{name}.{attr}"
            if inspect.isclass(obj):
                if not (obj.__dict__.get("__doc__") or "").strip():
                    out.append(where)
                for mname, member in vars(obj).items():
                    if mname.startswith("_"):
                        continue
                    fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                    if not (inspect.isfunction(fn) or isinstance(member, property)):
                        continue
                    doc = inspect.getdoc(getattr(obj, mname)) if not isinstance(member, property) else fn.__doc__
                    if not (doc or "").strip():
                        out.append(f"{where}.{mname}")
            elif not (obj.__doc__ or "").strip():
                out.append(where)
    return sorted(set(out))


def on_page_markdown(markdown, page, config, files):
    docs_dir = os.path.abspath(config.docs_dir)
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    here = os.path.dirname(os.path.join(docs_dir, page.file.src_path))
    repo_url = (config.repo_url or "").rstrip("/")

    def fix(m):
        label, target = m.group(1), m.group(2)
        if "://" in target or target.startswith(("#", "mailto:")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, path))
        if full.startswith(docs_dir + os.sep) or full == docs_dir:
            return m.group(0)                     # a page of the site: mkdocs checks it
        rel = os.path.relpath(full, root)
        if rel.startswith("..") or not os.path.exists(full):
            log.warning("%s links to %r, which is not a file of the repository", page.file.src_path, target)
            return m.group(0)
        if repo_url:
            return f"[{label}]({repo_url}/blob/main/{rel}{'#' + anchor if anchor else ''})"
        return label

    return _LINK.sub(fix, markdown)

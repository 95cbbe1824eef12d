"""The README as a front page and the documentation site's sources.

The site itself is built (``mkdocs build --strict``) by .ci/run after the
tests; these checks need no docs packages: the README's two commands are the
ones CI runs, its links land on files, every page in the site's navigation
exists, and the docstring rewriting of ``docs/griffe_ringlet.py`` works.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 200
    assert "2 hosts x 2 ranks, TCP" in README  # the cross-host headline row


def test_readme_commands_are_the_ones_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [ci[i + 1] for i, line in enumerate(ci) if line.startswith("# README,")]
    assert len(commands) == 2
    # Each runs in a subshell, so that a failure anywhere in its && list fails CI.
    assert all(c.startswith("(") and c.endswith(")") for c in commands), commands
    commands = [c[1:-1] for c in commands]
    fenced = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    for command in commands:
        assert command in fenced, f"README lacks the command .ci/run runs: {command}"


def test_readme_links_land_on_files() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_every_page_in_the_navigation_exists() -> None:
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    pages = re.findall(r"([\w./-]+\.md)\s*$", nav, re.M)
    assert "index.md" in pages and "api/ringlet.md" in pages
    missing = [p for p in pages if not (ROOT / "docs" / p).exists()]
    assert not missing, missing


def _griffe_ringlet() -> Any:
    path = ROOT / "docs" / "griffe_ringlet.py"
    spec = importlib.util.spec_from_file_location("griffe_ringlet", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # griffe comes with the docs extra
        import pytest

        pytest.skip("griffe is not installed (pip install '.[docs]')")
    return module


def test_docstring_rewriting() -> None:
    rewrite = _griffe_ringlet().rewrite
    doc = (
        "Runs.\n\nArgs:\n  x: see :func:`ringlet.init` and :class:`~a.B`.\n\n"
        "Example:\n  >>> f(1)\n  2\n\nReturns:\n  int: y\n"
    )
    out = rewrite(doc)
    assert "see `ringlet.init` and `B`." in out
    assert "Examples:\n  >>> f(1)\n  2\n\nReturns:" in out
    shell = "Run it.\n\nExample:\n  torchrun a\n  mpirun b\n"
    fenced = rewrite(shell)
    assert fenced == "Run it.\n\nExamples:\n  ```text\n  torchrun a\n  mpirun b\n  ```\n"
    assert rewrite(fenced) == fenced


def test_configuration_page_names_every_variable() -> None:
    """Every ``RINGLET_*`` environment variable the package, the core or the
    examples read (a quoted name in Python, ``env::var("...")`` in Rust)."""
    reads = {
        "python": (r"[\"'](RINGLET_[A-Z0-9_]+)[\"']", "*.py"),
        "examples": (r"[\"'](RINGLET_[A-Z0-9_]+)[\"']", "*.py"),
        "rust": (r"env::var(?:_os)?\(\s*\"(RINGLET_[A-Z0-9_]+)\"", "*.rs"),
    }
    found: set[str] = set()
    for folder, (pattern, glob) in reads.items():
        for path in (ROOT / folder).rglob(glob):
            found |= set(re.findall(pattern, path.read_text()))
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(name for name in found if f"`{name}`" not in page)
    assert len(found) >= 10 and not missing, missing


def test_every_limit_names_the_test_that_shows_it() -> None:
    """Each item of docs/limits.md names a test (``tests/<file>.py::<test>``)
    that exists, so the page cannot claim what the suite does not show."""
    text = (ROOT / "docs" / "limits.md").read_text()
    items = re.split(r"\n- ", text.split("\n- ", 1)[1])
    assert len(items) >= 8
    for item in items:
        named = re.findall(r"tests/([\w/]+\.py)::(test_\w+)", item)
        assert named, f"a limit names no test: {item[:120]!r}"
        for path, name in named:
            source = (ROOT / "tests" / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"no {name} in tests/{path}"

"""A griffe extension for ringlet's docstrings (used by mkdocs.yml's mkdocstrings).

ringlet's docstrings are Google style, as Napoleon reads it: their doctests
sit under ``Example:``, and they name other objects with Sphinx roles
(``:func:`init```). griffe's Google parser knows ``Examples:`` (and treats
``Example:`` as an admonition whose ``>>>`` lines Markdown renders as nested
quotes), and Markdown has no roles. So, before griffe parses a docstring:

* an ``Example:`` section header becomes ``Examples:``; a section without a
  ``>>>`` line (shell commands: ``torchrun ... -m ringlet.bench ...``) is put
  in a fenced code block, so its lines stay lines;
* ``:func:`x```, ``:class:`x``` and the other roles become the code span
  ```x``` (``~a.b`` becomes ``b``);
* a reStructuredText link, ```text <https://...>`_``, becomes a Markdown one.

The docstrings themselves are left as they are, for ``help()`` and IDEs.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADER = re.compile(r"^(\s*)Examples?:\s*$")
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")
_LINK = re.compile(r"`([^`<]+?)\s*<(https?://[^>]+)>`__?")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _short(match: re.Match[str]) -> str:
    name = match.group(1)
    if match.group(0).split("`", 1)[1].startswith("~"):
        name = name.rsplit(".", 1)[-1]
    return f"`{name}`"


def rewrite(text: str) -> str:
    """The docstring ``text`` as griffe's Google parser and Markdown expect it."""
    text = _LINK.sub(r"[\1](\2)", _ROLE.sub(_short, text))
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _HEADER.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        ind = len(m.group(1))
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > ind):
            j += 1
        body = lines[i + 1 : j]
        end = len(body)
        while end and not body[end - 1].strip():
            end -= 1
        body, tail = body[:end], body[end:]
        out.append(f"{m.group(1)}Examples:")
        fenced = body and body[0].lstrip().startswith("```")
        if body and not fenced and not any(line.lstrip().startswith(">>>") for line in body):
            pad = " " * min(_indent(line) for line in body if line.strip())
            out += [f"{pad}```text", *body, f"{pad}```"]
        else:
            out += body
        out += tail
        i = j
    return "\n".join(out)


class RingletDocstrings(griffe.Extension):
    """Rewrites each object's docstring (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)

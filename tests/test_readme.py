"""The README's Python examples run as written.

The fenced ```python blocks are read from README.md at test time (so the test follows the
README as it changes) and executed in order in one namespace, as a reader pasting them into
one session would; the working directory is a temporary one, so nothing lands in the checkout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a markdown text, in order."""
    return [match.group(1) for match in FENCE.finditer(text)]


def section(text: str, heading: str) -> str:
    """The text under the level-2 `heading`, up to the next level-2 heading."""
    match = re.search(
        rf"^## {re.escape(heading)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL
    )
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def test_block_extraction() -> None:
    text = "intro\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a + 1\n```\n"
    assert python_blocks(text) == ["a = 1\n", "b = a + 1\n"]


def test_tour_has_python() -> None:
    assert python_blocks(section(README.read_text(), "A short tour")), (
        "README.md's 'A short tour' has no ```python block to run"
    )


def test_readme_python_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for number, block in enumerate(blocks, start=1):
        code = compile(block, f"README.md python block {number}", "exec")
        exec(code, namespace)  # noqa: S102 - the README's own examples

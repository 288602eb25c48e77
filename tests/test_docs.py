"""The documentation cannot rot: the configuration reference is generated,
relative links resolve, and every Python snippet in docs/ runs and prints
exactly the output shown under it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from sao.config.reference import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_configuration_reference_is_current() -> None:
    text = (DOCS / "configuration.md").read_text()
    assert text == reference_markdown(), (
        "docs/configuration.md is out of date: regenerate with "
        "`sao config --reference > docs/configuration.md`"
    )


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def _snippets(page: Path) -> list[tuple[str, str | None]]:
    """Each ```python block of ``page`` with the ```text block right after it, if any."""
    text = page.read_text()
    blocks = list(FENCE.finditer(text))
    out: list[tuple[str, str | None]] = []
    for i, block in enumerate(blocks):
        if block.group(1) != "python":
            continue
        expected = None
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        if nxt and nxt.group(1) == "text" and not text[block.end() : nxt.start()].strip():
            expected = nxt.group(2)
        out.append((block.group(2), expected))
    return out


def _run_page(page: Path) -> dict[str, object]:
    """Execute a page's Python blocks in order in one namespace, checking outputs."""
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for n, (code, expected) in enumerate(_snippets(page)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{page.name}[python block {n}]", "exec"), namespace)
        if expected is not None:
            assert out.getvalue() == expected, f"{page.name} python block {n} prints otherwise"
    return namespace


@pytest.mark.parametrize("page", [p for p in PAGES if _snippets(p)], ids=lambda p: p.name)
def test_snippets_run_and_print_what_is_shown(page: Path) -> None:
    _run_page(page)


@pytest.mark.slow
def test_environments_page_trains(tmp_path: Path) -> None:
    namespace = _run_page(DOCS / "environments.md")
    checkpoint, run = str(tmp_path / "checkpoint"), tmp_path / "run"
    namespace["make_checkpoint"](checkpoint)  # type: ignore[operator]
    namespace["main"](checkpoint, str(run))  # type: ignore[operator]
    assert (run / "metrics.jsonl").is_file()
    assert (run / "final" / "config.json").is_file()

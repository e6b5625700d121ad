"""The README's promises about itself: its test command is exactly what `.ci/run` runs, it stays a five-minute read,
and every page of the docs site is in its navigation (`mkdocs build --strict`, run by that command, checks the links
and the API reference)."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("(command -v chromium")]


def test_ci_runs_exactly_the_readmes_test_command():
    readme, ci = _commands((ROOT / "README.md").read_text()), _commands((ROOT / ".ci" / "run").read_text())
    assert len(readme) == 1 and readme == ci
    assert "mkdocs build --strict" in readme[0] and "-e experiments" in readme[0]


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_docs_page_is_in_the_navigation():
    def pages(nav):
        for item in nav:
            if isinstance(item, str):
                yield item
            else:
                for value in item.values():
                    yield from pages(value) if isinstance(value, list) else [value]

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == listed


def test_readme_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target

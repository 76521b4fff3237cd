"""The manual's links: every relative link of README.md and docs/*.md leads to a file, and a heading, that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside code blocks and code spans: where Markdown makes links and headings."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (code marks too), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's id on a page; a repeated heading gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = anchor(heading)
        out.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return out


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_anchor_rule():
    assert anchor("Your own code: plugins and `run` jobs") == "your-own-code-plugins-and-run-jobs"
    assert anchor("Multi-GPU and mixed fleets") == "multi-gpu-and-mixed-fleets"
    assert anchor("Fine-tuning and pretrained weights") == "fine-tuning-and-pretrained-weights"


def test_every_relative_link_leads_somewhere():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and (dest.suffix != ".md" or fragment not in anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert sum(len(links(p)) for p in PAGES) > 20  # the check saw the links


def test_every_page_is_in_the_index_and_the_readme():
    index, readme = links(ROOT / "docs" / "README.md"), links(ROOT / "README.md")
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert page.name in index, page.name
            assert f"docs/{page.name}" in readme, page.name

"""The front door read as a reader would: README.md and docs/results.md.

Every glossary term the README uses is defined in its Terms section (or sits in a link); every relative link
and image of the two pages resolves, anchors included; the page a reader reads (everything but the
collapsed file tree) stays within READABLE_LINES; no build hash or tracker reference; the README's results
table is docs/results.md's; the file tree lists every source, benchmark and doc file, and nothing that is
gone. Each check is a function run here on the real pages and, to show it can fail, on a broken copy.

Run: pytest tests/test_readme.py
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README, RESULTS = ROOT / "README.md", ROOT / "docs" / "results.md"
GLOSSARY = ("H1", "arm", "deployed model", "control", "V_hack", "knob", "organism", "hack rate", "solve rate",
            "well-formed")
READABLE_LINES = 220  # the README outside its collapsed file tree
TREE_RE = re.compile(r"<details><summary>[^\n]*</summary>\n\n```\n(.*?)```\n\n</details>", re.S)
TABLE_RE = re.compile(r"<!-- results-table -->\n.*?<!-- /results-table -->", re.S)
# a build or commit hash (hex, 6+ characters, digits and letters both), a tracker's issue, a work session
FORBIDDEN = {"hash": r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{6,}\b", "issue": r"\bissues? #?\d+",
             "session": r"\bsessions?\b(?!\.py)"}  # run/session.py is a module's name


def _terms_section(text: str) -> str:
    m = re.search(r"^## Terms\n(.*?)(?=^## )", text, re.S | re.M)
    return m.group(1) if m else ""


def undefined_terms(text: str) -> list[str]:
    """Glossary terms used in `text` outside its Terms section that the section does not define
    (a line `- **term**: ...`) and that appear in no link text."""
    terms = _terms_section(text)
    rest = text.replace(terms, "")
    links = " ".join(re.findall(r"\[([^\]]*)\]\(", rest))
    out = []
    for term in GLOSSARY:
        used = re.search(rf"(?<![\w-]){re.escape(term)}s?(?![\w-])", rest, re.I)
        defined = re.search(rf"^- \*\*{re.escape(term)}\*\*: \S", terms, re.M | re.I)
        if used and not defined and term.lower() not in links.lower():
            out.append(term)
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: pathlib.Path, text: str | None = None) -> list[str]:
    """Relative links and images of `page` whose file, or whose #anchor in it, does not exist."""
    text = page.read_text(encoding="utf-8") if text is None else text
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links in code are not links
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            out.append(target)
        elif anchor:
            body = file.read_text(encoding="utf-8")
            ids = set(re.findall(r'id="([^"]+)"', body))
            ids |= {_slug(h) for h in re.findall(r"^#+ (.*)$", body, re.M)}
            if anchor not in ids:
                out.append(target)
    return out


def readable_lines(text: str) -> int:
    return len(TREE_RE.sub("", text).splitlines())


def forbidden(text: str) -> list[str]:
    return [f"{name}: {m.group(0)}" for name, rx in FORBIDDEN.items() for m in re.finditer(rx, text, re.I)]


def tree_paths(text: str) -> list[str]:
    """The paths the README's file tree lists: two spaces of indent per level, a folder ends with `/`."""
    m = TREE_RE.search(text)
    assert m, "README.md lost its file tree (a <details> block holding a code block)"
    stack: list[str] = []
    out = []
    for line in m.group(1).splitlines():
        name = line.strip().split()[0]
        depth = (len(line) - len(line.lstrip())) // 2
        stack = stack[:depth]
        path = "".join(stack) + name
        out.append(path)
        if name.endswith("/"):
            stack.append(name)
    return out


def tree_mismatch(listed: list[str]) -> tuple[list[str], list[str]]:
    """(files the tree leaves out, entries that do not exist)."""
    wanted = [p.relative_to(ROOT).as_posix() for p in (*ROOT.glob("src/projected_grpo/**/*.py"),
                                                       *ROOT.glob("benchmarks/*.py"), *ROOT.glob("docs/*.md"))
              if p.name != "__init__.py"]
    missing = sorted(set(wanted) - set(listed))
    stale = sorted(p for p in listed if not (ROOT / p).exists())
    return missing, stale


# --- the real pages --------------------------------------------------------------------------------------

def test_every_glossary_term_the_readme_uses_is_defined():
    text = README.read_text(encoding="utf-8")
    assert undefined_terms(text) == []
    assert all(re.search(rf"(?<![\w-]){re.escape(t)}", text, re.I) for t in GLOSSARY)  # each one is used


def test_relative_links_resolve():
    assert broken_links(README) == []
    assert broken_links(RESULTS) == []


def test_the_readme_reads_in_two_minutes_and_names_no_hash_issue_or_session():
    text = README.read_text(encoding="utf-8")
    assert readable_lines(text) <= READABLE_LINES
    assert forbidden(text) == []
    assert forbidden(RESULTS.read_text(encoding="utf-8")) == []


def test_the_readme_results_table_is_the_results_page_table():
    table = TABLE_RE.search(README.read_text(encoding="utf-8"))
    assert table, "README.md lost its <!-- results-table --> block"
    assert table.group(0) in RESULTS.read_text(encoding="utf-8")


def test_the_file_tree_lists_every_file_and_nothing_gone():
    assert tree_mismatch(tree_paths(README.read_text(encoding="utf-8"))) == ([], [])


# --- each check can fail -----------------------------------------------------------------------------------

def test_the_checks_fail_on_a_broken_readme(tmp_path):
    good = README.read_text(encoding="utf-8")
    # a definition dropped: `knob` is still used elsewhere, so it is reported
    no_knob = re.sub(r"^- \*\*knob\*\*:.*\n", "", good, flags=re.M)
    assert undefined_terms(no_knob) == ["knob"]
    # no Terms section at all: every term the page uses outside a link is reported
    got = undefined_terms("An arm of the organism, its hack rate.\n")
    assert set(got) == {"arm", "organism", "hack rate"}
    # a link to a missing file, and to a missing anchor
    page = tmp_path / "README.md"
    page.write_text("[a](docs/nowhere.md) [b](#no-such-heading) [c](https://example.org)\n"
                    "## Here\n[d](#here)\n")
    assert broken_links(page) == ["docs/nowhere.md", "#no-such-heading"]
    # a page too long to read, a build hash, a tracker reference
    assert readable_lines(good + "x\n" * READABLE_LINES) > READABLE_LINES
    assert forbidden("built as f78eec in issue 14, this session") == ["hash: f78eec", "issue: issue 14",
                                                                         "session: session"]
    assert forbidden("the 0.54M model, 2026-11-25, seeds 0-2, AdamW, session.py") == []
    # a file the tree forgets, and one it lists that is gone
    listed = tree_paths(good)
    missing, stale = tree_mismatch([p for p in listed if p != "src/projected_grpo/study/summary.py"]
                                   + ["src/projected_grpo/gone.py"])
    assert missing == ["src/projected_grpo/study/summary.py"] and stale == ["src/projected_grpo/gone.py"]

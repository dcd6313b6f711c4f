"""docs/tasks.md cannot drift from the example it teaches: each code block captioned with a file
is that file's text (the blocks of one file, in order, are the whole file, blank lines between
blocks aside), each "(excerpt)" block is verbatim lines of its file, and the block marked
``<!-- test: run -->`` runs."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "tasks.md"
EXAMPLE = REPO_ROOT / "examples" / "running_sum"
SHOWN_IN_FULL = sorted([p.relative_to(REPO_ROOT).as_posix() for p in EXAMPLE.glob("*.py")]
                       + ["run_configs/running_sum.toml"])

CAPTIONED = re.compile(r"^`([^`\s]+)`( \(excerpt\))?\n```\w+\n(.*?)^```$", re.M | re.S)
RUN = re.compile(r"^<!-- test: run -->\n```python\n(.*?)^```$", re.M | re.S)


def _blocks() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({file: its full-file blocks in doc order}, {file: its excerpt blocks})."""
    full: dict[str, list[str]] = {}
    excerpts: dict[str, list[str]] = {}
    for path, excerpt, body in CAPTIONED.findall(DOC.read_text()):
        (excerpts if excerpt else full).setdefault(path, []).append(body)
    return full, excerpts


def _mismatch(path: str, expected: list[str], shown: list[str], at: int) -> str:
    i = next((i for i, (a, b) in enumerate(zip(expected, shown)) if a != b),
             min(len(expected), len(shown)))
    file_line = expected[i] if i < len(expected) else "<end of file>"
    return (f"docs/tasks.md shows {path} line {at + i + 1} as {shown[i]!r}; the file has "
            f"{file_line!r}. Update the doc's blocks to the file.")


@pytest.mark.parametrize("path", SHOWN_IN_FULL)
def test_the_guide_shows_each_example_file_whole_and_verbatim(path: str) -> None:
    full, _ = _blocks()
    assert path in full, f"docs/tasks.md shows no block captioned `{path}`"
    lines = (REPO_ROOT / path).read_text().splitlines()
    at = 0
    for block in full[path]:
        while at < len(lines) and not lines[at].strip():  # blank lines between blocks
            at += 1
        shown = block.splitlines()
        expected = lines[at: at + len(shown)]
        assert expected == shown, _mismatch(path, expected, shown, at)
        at += len(shown)
    rest = [line for line in lines[at:] if line.strip()]
    assert not rest, f"docs/tasks.md leaves out the end of {path}, from {rest[0]!r}"


def test_the_guide_captions_only_files_it_is_checked_against() -> None:
    full, excerpts = _blocks()
    assert sorted(full) == SHOWN_IN_FULL
    assert excerpts, "the guide quotes the library's Task protocol and EnvStep"
    for path, blocks in excerpts.items():
        text = "\n".join((REPO_ROOT / path).read_text().splitlines())
        for block in blocks:
            assert block.rstrip("\n") in text, (
                f"docs/tasks.md quotes {path} where the file no longer reads so:\n{block}")


def test_the_guides_try_it_by_hand_block_runs() -> None:
    blocks = RUN.findall(DOC.read_text())
    assert len(blocks) == 1
    exec(compile(blocks[0], f"{DOC}:try-it-by-hand", "exec"), {"__name__": "tasks_md"})

"""The repository's own rules: one-way imports, a product's vocabulary, files of a readable size,
a README whose commands are the ones CI runs."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yaml", ".yml", ".json", ""}

# Talk of how the code was made rather than of what it is: run, session and issue numbers, rounds
# of code inspection, whose machines ran what, and pointers to notes that are not in the repository.
_WORD = "|".join(["r" + "uns? \\d+", "s" + "essions? \\d+", "i" + "ssues? \\d+", "_r" + "un\\d+",
                  "r" + "eview(?:s|ed|er|ers|ing)?", "l" + "ent", "b" + "orrowed", "l" + "oan(?:s|ed)?",
                  "l" + "eased?"])
BUILD_TALK = re.compile(rf"(?i:\b(?:{_WORD})\b)|DESIGN\.md|limits-" + "h200|\\.\\./shared|/" + "work/")

MAX_LIBRARY_LINES = 650


def _tracked_files() -> list[Path]:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run([git, "ls-files", "-z"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return [ROOT / p for p in out.split("\0") if p]


def test_imports_run_one_way():
    """layouts <- collectives <- kernels <- layers <- integrations ([tool.importlinter] in pyproject.toml)."""
    linter = shutil.which("lint-imports")
    if linter is None:
        pytest.fail("import-linter is not installed: pip install -e '.[test]'")
    proc = subprocess.run([linter], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f"lint-imports failed:\n{proc.stdout}\n{proc.stderr}"


def test_the_repository_speaks_of_the_product():
    hits = []
    for path in _tracked_files():
        if path.suffix not in TEXT_SUFFIXES or path.name == "LICENSE" or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            m = BUILD_TALK.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)!r} in {line.strip()[:120]}")
    assert not hits, f"{len(hits)} lines talk about the build process, not the product:\n" + "\n".join(hits[:60])


def test_library_files_are_of_a_readable_size():
    big = []
    for base in ("fusedpar",):
        for path in sorted((ROOT / base).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > MAX_LIBRARY_LINES:
                big.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not big, f"library files over {MAX_LIBRARY_LINES} lines:\n" + "\n".join(big)


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
    assert block, "README.md must open with a bash block of the two fresh-machine commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_the_two_commands_ci_runs_one_of():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md is for users: at most ~200 lines, details in docs/"
    assert readme.index("```bash") < 400, "the two fresh-machine commands come first"
    demo, tests = _readme_commands()[:2]
    assert "python -m fusedpar demo" in demo
    assert tests.endswith("python -m pytest -n 2")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci, f".ci/run must run the README's test command:\n{tests}"


def test_version_has_one_source():
    import importlib.metadata
    import sys

    import fusedpar

    out = subprocess.run([sys.executable, "-m", "fusedpar", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == f"fusedpar {fusedpar.__version__}", out
    assert importlib.metadata.version("fusedpar") == fusedpar.__version__
    assert "version =" not in (ROOT / "pyproject.toml").read_text().split("[project]")[1].split("[")[0]

"""The batch script stays readable (issue 47): directives, the environment, the launch line and
the hand-over to the supervisor; the decisions live in jobgen.job. ``_launch.j2`` holds at most
150 lines, and no shell function of a golden script (the runs' and the serve jobs') runs over 30 lines."""

from __future__ import annotations

import re

from helpers import GOLDEN
from jobgen.base.paths import TEMPLATES_DIR

MOST_LAUNCH_LINES = 150
MOST_FUNCTION_LINES = 30
_START = re.compile(r"^(\s*)([A-Za-z_][\w]*)\(\)\s*\{\s*(#.*)?$")


def functions(text: str) -> dict[str, int]:
    """Each multi-line shell function of a script and its length in lines (its braces included):
    a function opens with ``name() {`` and closes with ``}`` at the same indentation."""
    found, lines = {}, text.splitlines()
    for i, line in enumerate(lines):
        start = _START.match(line)
        if not start:
            continue
        indent = start.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == f"{indent}}}"), None)
        assert end is not None, f"function {start.group(2)} at line {i + 1} has no closing brace"
        found[start.group(2)] = end - i + 1
    return found


def test_the_launch_template_is_short():
    lines = (TEMPLATES_DIR / "_launch.j2").read_text().splitlines()
    assert len(lines) <= MOST_LAUNCH_LINES, f"_launch.j2 has {len(lines)} lines"


def test_no_shell_function_of_a_rendered_script_is_long():
    scripts = sorted(GOLDEN.glob("*.sbatch"))
    assert scripts
    long = {
        f"{script.name}: {name}": count
        for script in scripts
        for name, count in functions(script.read_text()).items()
        if count > MOST_FUNCTION_LINES
    }
    assert not long, f"shell functions over {MOST_FUNCTION_LINES} lines: {long}"


def test_the_counter_finds_a_long_function():
    body = "\n".join(["f() {", *["  echo"] * 31, "}", "g() { :; }", "  h() {", "  }"])
    assert functions(body) == {"f": 33, "h": 2}

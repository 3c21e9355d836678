"""The test profile: "default" (the README's test command, what CI runs) or "deep" (`python -m pytest --deep`).

The deep profile also runs the tests marked `deep` (every model family and configuration of the
vLLM engine tests) and multiplies the examples of the property tests by DEEP_EXAMPLES_FACTOR.
tests/conftest.py sets DEEP from the command line before any test module is collected.
"""

from __future__ import annotations

DEEP = False
DEEP_EXAMPLES_FACTOR = 5


def examples(n: int) -> int:
    """max_examples of a property test: n in the default profile, more in the deep one."""
    return n * DEEP_EXAMPLES_FACTOR if DEEP else n

"""The step modes and the argument checks shared by the layout objects (ValueError that names the numbers)."""

from enum import Enum


class StepMode(str, Enum):
    """The layout a forward step runs in: BASE (SP x TP) or SHIFT (TP over the whole replica).

    A str: a member equals its value ("base", "shift"), hashes, formats, prints and serializes as it,
    so a public function taking a mode takes the plain strings too, and dicts keyed by mode (such as
    ShiftParallelStack.steps) read, print and dump as they would with string keys."""

    BASE = "base"
    SHIFT = "shift"

    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__


MODES = tuple(StepMode)


def check_mode(mode: str) -> StepMode:
    """`mode` as a StepMode; ValueError naming the modes for anything else."""
    try:
        return StepMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {tuple(m.value for m in StepMode)}, got {mode!r}") from None


def positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value

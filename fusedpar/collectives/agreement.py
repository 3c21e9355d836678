"""Settings every rank of a collective call must share, checked by one exchange instead of assumed.

Ranks that pass different settings to a collective setup (a shift threshold, a layout, other
weights) would later hang in a collective or silently mix their results. check_agreement gathers
each rank's settings once and raises on every rank, naming each setting that differs and which
ranks hold which value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_checksum(t: torch.Tensor, samples: int = 1 << 20) -> int:
    """An exact, order-independent checksum of up to `samples` evenly strided elements of t (their
    bit patterns summed as integers): equal tensors give equal sums on any device."""
    flat = t.detach().reshape(-1)
    flat = flat[:: max(1, flat.numel() // samples)]
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return int(flat.view(bits).to(torch.int64).sum().item())


def disagreement(name: str, values: list, ranks, show=repr) -> str | None:
    """None if every rank's value equals the first, else "name: rank(s) a, b: value; rank c: value"
    (`values` in the order of `ranks`; `show` renders a value)."""
    if all(v == values[0] for v in values[1:]):
        return None
    holders: dict[str, list[int]] = {}
    for rank, value in zip(ranks, values, strict=True):
        holders.setdefault(show(value), []).append(rank)
    return f"{name}: " + "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {value}"
                                   for value, r in holders.items())


def check_agreement(what: str, settings: dict[str, object], group=None) -> None:
    """Raise ValueError on every rank of `group` (default: the world) unless every rank passed equal
    `settings` (compared with ==). Collective: every rank calls it with the same keys."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, settings, group=group)
    problems = [p for key in sorted({k for g in gathered for k in g}, key=str)
                if (p := disagreement(key, [g.get(key) for g in gathered], range(world))) is not None]
    if problems:
        raise ValueError(f"{what}: the ranks disagree on {len(problems)} setting(s), and every rank must make this "
                         f"call with the same model and arguments: " + " | ".join(problems))

"""Text of a cluster plan of groups (`exo-tp plan --model A --model B ...`): every group's
model, layout (one group or replicas) and devices, what it is predicted to do, and the memory
each device has left."""

from __future__ import annotations

from collections.abc import Sequence

from exo_tp.plan.groups import Group, GroupsPlan
from exo_tp.plan.human import duration, size
from exo_tp.plan.render_choice import describe_candidate
from exo_tp.plan.replicas import Replicas


def _replica_lines(layout: Replicas, names: Sequence[str]) -> list[str]:
    lines = []
    for index, (subset, choice) in enumerate(zip(layout.subsets, layout.choices, strict=True)):
        own = [names[d] for d in subset]
        label = f"replica {index}" if len(layout.subsets) > 1 else "group"
        streams = layout.streams[index]
        lines.append(
            f"  {label}: {describe_candidate(choice.best, own)}; "
            f"{duration(choice.best.prediction.decode_seconds)} a token alone"
            + (f", {streams} of the priced streams" if len(layout.subsets) > 1 else "")
        )
    return lines


def _group_lines(group: Group, names: Sequence[str]) -> list[str]:
    choice = group.choice
    layout = choice.best
    held = ", ".join(f"{names[d]} {size(b)}" for d, b in sorted(layout.memory().items()))
    lines = [
        f"{group.key}{' (pinned)' if group.pinned else ''}: {choice.reason}",
        *_replica_lines(layout, names),
        f"  memory held: {held}",
    ]
    for other in choice.options[1:]:
        count = len(other.subsets)
        what = "one group" if count == 1 else f"{count} replicas"
        lines.append(
            f"  compared: {what}: {other.tokens_per_second:.3g} tokens/s at {choice.streams} "
            f"streams, {duration(other.decode_seconds)} a token alone"
        )
    lines += [f"  {count} replicas: {why}" for count, why in choice.rejected]
    return lines


def render_groups(plan: GroupsPlan, names: Sequence[str]) -> str:
    lines: list[str] = []
    for group in plan.groups:
        lines += [*_group_lines(group, names), ""]
    left = ", ".join(
        f"{n} {size(m)} of {size(total)}"
        for n, m, total in zip(names, plan.left, plan.memory, strict=True)
    )
    lines.append(f"memory left for more models: {left}")
    return "\n".join(lines)

"""Human-readable text of a predicted plan and of the planner's comparison (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from exo_tp.arch import mode_reason
from exo_tp.plan.cluster import Cluster
from exo_tp.plan.human import duration, rate, size
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.predict import Prediction
from exo_tp.plan.render import render_plan
from exo_tp.plan.search import Candidate, Choice


def render_prediction(plan: PipelinePlan, prediction: Prediction, names: Sequence[str]) -> str:
    """Per stage and rank: layers, share, memory, and where a token's time goes."""
    lines = [
        f"{'rank':>4} {'device':<28} {'stage':>5} {'layers':>7} {'share':>6} "
        f"{'weights':>9} {'KV cache':>9} {'limit':>9}"
    ]
    for m in prediction.memory:
        index, local = plan.locate(m.rank)
        stage = plan.stages[index]
        lines.append(
            f"{m.rank:>4} {names[m.device][:28]:<28} {index:>5} "
            f"{f'{stage.layers.start}-{stage.layers.stop}':>7} {stage.tp.weights[local]:>6.3f} "
            f"{size(m.weights):>9} {size(m.kv_cache):>9} {size(m.limit):>9}"
            + ("" if m.fits else "  OVER")
        )
    for m in prediction.memory:
        if m.draft:
            lines.append(
                f"draft model: whole beside the conductor, rank {m.rank} on "
                f"{names[m.device]}: {size(m.draft)} with its KV cache (in the rank's total)"
            )
        if m.tower:
            lines.append(
                f"vision tower: whole beside rank {m.rank}'s shard on {names[m.device]}: "
                f"{size(m.tower)} (in the rank's total), "
                f"{duration(prediction.tower_seconds)} per image"
            )
    for index, s in enumerate(prediction.stages):
        link = (
            f"ring link all_sum {duration(s.link.latency)} at 4 KB, "
            f"{rate(s.link.bandwidth)} ({'measured' if s.link.measured else 'assumed'})"
            if s.link
            else "one rank"
        )
        lines.append(
            f"stage {index}: compute {duration(s.compute_seconds)}, collectives "
            f"{duration(s.collective_seconds)} per token; {link}"
        )
    if len(prediction.stages) > 1:
        lines.append(f"hops: {duration(prediction.hop_seconds)} per token")
    lines.append(
        f"predicted decode: {duration(prediction.decode_seconds)} per token "
        f"({prediction.tokens_per_second:.3g} tokens/s); prefill of {prediction.prompt_tokens} "
        f"tokens: {duration(prediction.prefill_seconds)}; KV cache for "
        f"{prediction.context_tokens} tokens of context{_streams(prediction)}"
    )
    if prediction.context_fits is not None:
        lines.append(
            f"memory holds {prediction.context_fits} tokens of context per stream"
            f"{_streams(prediction)} (the fullest rank decides)"
        )
    return "\n".join(lines)


def _streams(prediction: Prediction) -> str:
    streams = prediction.memory[0].streams if prediction.memory else 1
    return f" x {streams} streams" if streams > 1 else ""


def _fits(prediction: Prediction) -> str:
    fits = prediction.context_fits
    return "any" if fits is None else str(fits)


def render_links(cluster: Cluster) -> list[str]:
    """Each pair's link: measured (how, and when) or assumed."""
    names = [d.name for d in cluster.devices]
    if len(names) < 2:
        return []
    lines = ["links:"]
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            measured = next((x for x in cluster.links if {x.a, x.b} == {a, b}), None)
            cost = measured.cost if measured else cluster.default_link
            how = f"measured ({measured.origin})" if measured else "assumed (not measured)"
            lines.append(
                f"  {names[a]} - {names[b]}: all_sum {duration(cost.latency)} at 4 KB, "
                f"{rate(cost.bandwidth)}; {how}"
            )
    return lines


def describe_candidate(candidate: Candidate, names: Sequence[str]) -> str:
    stages = " -> ".join(
        f"[{', '.join(names[d] for d in group)}] layers {s.layers.start}-{s.layers.stop}"
        for group, s in zip(candidate.groups, candidate.plan.stages, strict=True)
    )
    dropped = (
        f"; leaves out {', '.join(names[d] for d in candidate.dropped)}"
        if candidate.dropped
        else ""
    )
    return f"{candidate.kind}: {stages}{dropped}"


def render_choice(choice: Choice, cluster: Cluster) -> str:
    names = [d.name for d in cluster.devices]
    best = choice.best
    if choice.objective == "throughput":
        ranking = (
            f"ranked by every stream's tokens/s together at {choice.streams} streams, the "
            "stages overlapped (the slowest stage sets the pace; layers follow stage speed)"
        )
    else:
        ranking = "ranked by time per token of one request (the fastest stages hold most layers)"
    priced = [
        f"{d.name} by {len(d.matvec.points)} measured matrix shapes"
        if d.matvec.points
        else f"{d.name} per byte (its profile has no shapes of this model: exo-tp bench --model)"
        for d in cluster.devices
    ]
    headline = [d.name for d in cluster.devices if not d.score_measured]
    mode, why = mode_reason(best.plan.spec.model_type)
    lines = [
        f"model mode: {mode} ({why})",
        f"chosen: {describe_candidate(best, names)}",
        f"objective: {choice.objective} ({choice.reason}); {ranking}",
        f"weight reads priced: {'; '.join(priced)}",
        *(
            [
                f"headline decode score standing in (the model's weight format not measured): "
                f"{', '.join(headline)}"
            ]
            if headline
            else []
        ),
        *render_links(cluster),
        "",
    ]
    for index, stage in enumerate(best.plan.stages):
        if len(best.plan.stages) > 1:
            lines.append(f"stage {index}: layers {stage.layers.start}-{stage.layers.stop}")
        lines += [render_plan(stage.tp), ""]
    lines += [
        render_prediction(best.plan, best.prediction, names),
        "",
        f"compared ({choice.considered} plans considered, {len(choice.rejected)} do not fit):",
        f"{'':>2} {'tokens/s':>9} {'per token':>10} {'prefill':>9} "
        f"{f'@{choice.streams} streams':>12} {'context':>8}  plan",
    ]
    for mark, c in [("*", best)] + [(" ", c) for c in choice.alternatives]:
        p = c.prediction
        lines.append(
            f"{mark:>2} {p.tokens_per_second:>9.3g} {duration(p.decode_seconds):>10} "
            f"{duration(p.prefill_seconds):>9} {p.loaded_tokens_per_second:>8.3g} t/s"
            f" {_fits(p):>8}  {describe_candidate(c, names)}"
        )
    return "\n".join(lines)

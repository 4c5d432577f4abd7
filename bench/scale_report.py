"""Figure 5's section of the report (:mod:`bench.scale` measures it): the scale runs' rounds, the project
alone, the large run against its reference, the engine floor, and the saved large-run figure."""

from __future__ import annotations

import statistics
from typing import Any


def middle_rounds(seconds: list[float]) -> float:
    """The median of the rounds between the first and the last (``bench.scale.LARGE_ROUNDS``)."""
    return statistics.median(seconds[1:-1])


def scale_markdown(f5: dict[str, Any]) -> list[str]:
    """Figure 5's section of the report (with the saved large-run figure when this run made none)."""
    L: list[str] = []
    L += [
        f"## 5. Scale: {f5['clients']} simulated clients, {f5['per_round']} per round",
        "",
        f"Goal: {f5['goal']}.",
        "",
        "| availability.query | round | seconds | server s | nodes asked | query s | query ÷ round | server ÷ round "
        "| replies |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for query, r in f5["runs"].items():
        for i, (s, ss, na, qs, n) in enumerate(
            zip(r["round_seconds"], r["server_seconds"], r["queried"], r["query_seconds"], r["replies"]), 1
        ):
            L.append(
                f"| {query} | {i} | {s:.1f} | {ss:.2f} | {na} | {qs:.2f} | {100 * qs / s:.1f} % | "
                f"{100 * ss / s:.1f} % | {n} |"
            )
    L.append("")
    for query, r in f5["runs"].items():
        ratio = r["round1_over_round2"]
        L.append(
            f"- `{query}`: round 1 ÷ round 2 **{ratio:.2f}**; largest query share "
            f"**{100 * r['max_query_share']:.1f} %**; peak resident memory of the process tree (launcher, "
            f"SuperLink, ServerApp, Ray) **{r['peak_rss_bytes_process_tree'] / 2**30:.2f} GiB**; "
            f"job {r['job_wall_seconds']:.0f} s."
            + (
                f" Blocking query time per asked node {1000 * r['query_seconds_per_node']:.1f} ms."
                if r.get("query_seconds_per_node")
                else ""
            )
            + (
                f" Start-up before round 1 (Ray workers start on their first message, importing torch "
                f"and the ClientApp; nodes find their data): {r['startup_seconds']:.1f} s, "
                f"{r['startup_queried']} nodes asked."
                if r.get("startup_seconds") is not None
                else ""
            )
        )
    L += project_alone_markdown(f5.get("project_alone"))
    L.append("")
    if "large" in f5:
        L += large_markdown(f5["large"], f5)
    elif f5.get("large_saved"):
        L += saved_markdown(f5["large_saved"])
    return L


def project_alone_markdown(alone: dict[str, Any] | None) -> list[str]:
    """The bullet of :func:`project_alone`: the project's own rounds at its smallest and largest node count."""
    if not alone:
        return []
    (a, ra), (b, rb) = [(int(n), alone["rows"][str(n)]) for n in (alone["sizes"][0], alone["sizes"][-1])]
    return [
        f"- The project alone, in process (no Flower engine: `LocalGrid` calls the ClientApp's handlers "
        f"node by node; the large run's settings, {alone['per_round']} clients per round): rounds after the "
        f"first "
        + ", ".join(f"{sec:.2f} s" for sec in ra["round_seconds"][1:])
        + f" at {a:,} nodes, "
        + ", ".join(f"{sec:.2f} s" for sec in rb["round_seconds"][1:])
        + f" at {b:,}; median ratio "
        f"**{alone['later_rounds_ratio']:.2f}** (the project's own work per round: server, clients and "
        f"evaluation; near 1, it does not grow with the number of nodes)."
    ]


def saved_markdown(saved: dict[str, Any]) -> list[str]:
    """The section of a saved ``--scale-clients`` figure, saying where, when and how it was measured."""
    figure = saved["figure"]
    alone = project_alone_markdown(figure.get("project_alone"))
    return (
        large_markdown(figure["large"], figure)
        + alone
        + [""] * bool(alone)
        + [
            f"(Saved figure `bench/scale/scale-{figure['large']['clients']}.json`: measured {saved['date']} on "
            f"{saved['machine']} at commit {saved['commit']} by `{saved['command']}`, next to that run's own "
            f"{figure['clients']}-client rounds.)",
            "",
        ]
    )


def large_markdown(large: dict[str, Any], f5: dict[str, Any]) -> list[str]:
    """The large run's rows, its ratios against the 1000-client run and the per-node state."""
    L: list[str] = []
    r, st = large["run"], large["server_state"]
    L += [
        f"### {large['clients']:,} simulated clients, {f5['per_round']} per round (`availability.query=sampled`)",
        "",
        f"Goal: {large['goal']}.",
        "",
        "| round | seconds | server s | nodes asked | replies |",
        "|---|---|---|---|---|",
    ]
    for i, (sec, ss, na, n) in enumerate(zip(r["round_seconds"], r["server_seconds"], r["queried"], r["replies"]), 1):
        L.append(f"| {i} | {sec:.1f} | {ss:.2f} | {na} | {n} |")
    ref = large.get("reference")
    if ref:
        L += [
            "",
            f"Both runs: {', '.join(large['overrides'])}. The {f5['clients']}-client reference's rounds: "
            + ", ".join(f"{sec:.1f} s" for sec in ref["round_seconds"])
            + f" (peak memory "
            f"{ref['peak_rss_bytes_process_tree'] / 2**30:.2f} GiB, start-up {ref['startup_seconds'] or 0:.1f} s).",
        ]
    middle = r.get("middle_over_small_middle")
    L += [
        "",
        f"- round 2 ÷ the {f5['clients']}-client round 2: **{r['round2_over_small_round2']:.2f}**"
        + (
            f" (the median of rounds 2–{len(r['round_seconds']) - 1} ÷ the reference's: {middle:.2f})"
            if middle is not None
            else ""
        )
        + "; "
        f"peak resident memory of the process tree **{r['peak_rss_bytes_process_tree'] / 2**30:.2f} GiB**; "
        f"start-up before round 1 {r['startup_seconds'] or 0:.1f} s ({r['startup_queried']} nodes asked); "
        f"job {r['job_wall_seconds']:.0f} s.",
        f"- The server's per-node state ({st['note']}): "
        + ", ".join(
            f"{int(k):,} nodes {v['server_state_bytes'] / 2**20:.2f} MiB "
            f"({v['bytes_per_known_node']:.0f} B per known node)"
            for k, v in st["rows"].items()
        )
        + f"; **{st['bytes_per_node']:.0f} bytes per node** (slope).",
    ]
    return L + engine_markdown(large.get("engine_floor"), r, ref, f5["clients"], large["clients"]) + [""]


def engine_markdown(
    engine: dict[str, Any] | None, run: dict[str, Any], reference: dict[str, Any] | None, small: int, large: int
) -> list[str]:
    """The engine floor's bullet: Flower alone with the same traffic, its ratio beside ours."""
    if not engine or not reference:
        return []
    at_small, at_large = engine["runs"][f"query-{small}"], engine["runs"][f"query-{large}"]
    return [
        f"- Flower's simulation engine alone (`{engine['code']}`: a bare ServerApp and ClientApp, nothing "
        f"from the project, the same messages: {at_small['per_round']} training messages and the next round's "
        f"{at_small['per_round']} node-info queries per round; its client spends {engine['work_ms']:.1f} ms of CPU "
        f"per training message, fitted to make its {small:,}-node rounds as long as the reference's: middle rounds "
        f"{middle_rounds(at_small['round_seconds']):.1f} s against {middle_rounds(reference['round_seconds']):.1f} s): "
        f"round 2 {at_large['round_seconds'][1]:.1f} s at {large:,} nodes ÷ {at_small['round_seconds'][1]:.1f} s at "
        f"{small:,} = "
        f"**{engine['query_round2_ratio']:.2f}** (middle rounds {engine['query_middle_ratio']:.2f}); without the "
        f"queries {engine['no-query_round2_ratio']:.2f} (middle rounds {engine['no-query_middle_ratio']:.2f}). "
        f"This project at {large:,} ÷ the engine alone at {large:,}, round 2: "
        f"**{run['round_seconds'][1] / at_large['round_seconds'][1]:.2f}**."
    ]

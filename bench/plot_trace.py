#!/usr/bin/env python3
"""Draws an intra-kernel profiler trace (Chrome trace JSON from tdist-profile or
tdist::write_chrome_trace, docs/profiling.md) as a timeline picture: one row per track (a block's
producer or math thread, a collective block), grouped by rank, time on the x axis; spans coloured by
kind (tile, wait, copy, user), a span nested in another drawn thinner on top of it, instants as ticks.

    python3 bench/plot_trace.py trace.json out.png [--kernel ag_gemm] [--blocks 16] [--max-rows 96] [--ranks 0,1]

Any Chrome trace with B/E pairs or X events draws; other phases are left out.
"""
import argparse
import json
import re
import sys
from collections import defaultdict

COLOURS = {"tile": "#4c72b0", "wait": "#dd5555", "copy": "#55a868", "user": "#8172b2", "mark": "#222222"}
OTHER = "#999999"


def load(path):
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents array")
    return events


def tracks_of(events):
    """{(pid, tid): {"name", "sort", "spans": [(t0, t1, name, depth)], "marks": [(t, name)]}}"""
    tracks = defaultdict(lambda: {"name": None, "sort": None, "spans": [], "marks": []})
    procs = {}
    open_spans = defaultdict(list)
    # B/E pair in file order per track (the writer emits them so); sort by ts keeps E after its B.
    timed = [e for e in events if e.get("ph") in ("B", "E", "X", "i", "I")]
    timed.sort(key=lambda e: float(e["ts"]))
    for e in events:
        if e.get("ph") != "M":
            continue
        key = (e.get("pid", 0), e.get("tid", 0))
        if e["name"] == "thread_name":
            tracks[key]["name"] = e["args"]["name"]
        elif e["name"] == "thread_sort_index":
            tracks[key]["sort"] = e["args"]["sort_index"]
        elif e["name"] == "process_name":
            procs[e.get("pid", 0)] = e["args"]["name"]
    for e in timed:
        key = (e.get("pid", 0), e.get("tid", 0))
        t = float(e["ts"])
        ph = e["ph"]
        if ph == "B":
            open_spans[key].append((t, e.get("name", "")))
        elif ph == "E":
            if open_spans[key]:
                t0, name = open_spans[key].pop()
                tracks[key]["spans"].append((t0, t, name, len(open_spans[key])))
        elif ph == "X":
            tracks[key]["spans"].append((t, t + float(e.get("dur", 0)), e.get("name", ""), 0))
        else:
            tracks[key]["marks"].append((t, e.get("name", "")))
    return {k: v for k, v in tracks.items() if v["spans"] or v["marks"]}, procs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="Chrome trace JSON")
    ap.add_argument("out", help="picture to write (.png, .svg, .pdf)")
    ap.add_argument("--kernel", help="only tracks whose name starts with this (e.g. ag_gemm, ag_push)")
    ap.add_argument("--ranks", help="only these pids, a comma list")
    ap.add_argument("--blocks", type=int, default=16,
                    help="only tracks of blocks below this, per kernel (default 16; 0: every block)")
    ap.add_argument("--max-rows", type=int, default=96, help="tracks drawn per rank at most (default 96)")
    ap.add_argument("--title", help="the picture's title (default: the file name)")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tracks, procs = tracks_of(load(args.trace))
    ranks = None if not args.ranks else {int(r) for r in args.ranks.split(",")}
    by_rank = defaultdict(list)
    for (pid, tid), tr in tracks.items():
        if ranks is not None and pid not in ranks:
            continue
        if args.kernel and not (tr["name"] or "").startswith(args.kernel):
            continue
        m = re.search(r"\bblock (\d+)\b", tr["name"] or "")
        if args.blocks > 0 and m and int(m.group(1)) >= args.blocks:
            continue
        by_rank[pid].append((tr["sort"] if tr["sort"] is not None else tid, tid, tr))
    if not by_rank:
        sys.exit(f"plot_trace.py: no track to draw in {args.trace}")

    rows = []  # (label, track), top to bottom
    for pid in sorted(by_rank):
        chosen = sorted(by_rank[pid], key=lambda x: (x[0], x[1]))[: args.max_rows]
        for _, tid, tr in chosen:
            rows.append((f"{procs.get(pid, f'rank {pid}')}: {tr['name'] or tid}", tr))
    end = max([s[1] for _, tr in rows for s in tr["spans"]] + [m[0] for _, tr in rows for m in tr["marks"]] + [1e-3])

    fig_h = min(2.0 + 0.16 * len(rows), 60)
    fig, ax = plt.subplots(figsize=(14, fig_h))
    used = set()
    for y, (_, tr) in enumerate(rows):
        for t0, t1, name, depth in sorted(tr["spans"], key=lambda s: s[3]):
            h = 0.8 if depth == 0 else 0.45
            # White edges keep back-to-back spans (consecutive tiles) apart.
            ax.broken_barh([(t0, max(t1 - t0, end * 1e-4))], (y - h / 2, h), facecolors=COLOURS.get(name, OTHER),
                           edgecolor="white", linewidth=0.4)
            used.add(name)
        for t, name in tr["marks"]:
            ax.plot([t, t], [y - 0.45, y + 0.45], color=COLOURS["mark"], linewidth=0.8)
            used.add("mark")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=6 if len(rows) > 40 else 8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time (us, from the first record)")
    ax.set_title(args.title or args.trace)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=COLOURS.get(n, OTHER), label=n) for n in sorted(used)], loc="upper right",
              fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}: {len(rows)} tracks, {end:.1f} us")


if __name__ == "__main__":
    main()

"""Issue 11's targets, judged from one run of the lookup benchmark or the median of several.

Per table set and workload: `lookup_many` (the one native call the collection and the DMP
kernel run) against FBGEMM's TBE, >= 1.0x on Zipf ids and >= 0.8x on uniform ids; the IBP
collection against TorchRec's fused EBC, >= 1.0x on both. A workload the benchmark also
runs on every usable CPU ("@2 thr") is judged by the same lines, and on 2 threads against
its 1-thread twin by the scaling line: `lookup_many` at >= 1.7x its 1-thread speed wherever
FBGEMM's TBE scaled that well in the same run (on other thread counts the speedups are
reported, not judged). bf16 sets, which FBGEMM's CPU kernel does not pool, have no pair
and are left out.

A single run moves a set's ratio by 0.1x and more (the host's phases), so several runs are
combined by the median of each run's ratio (itself the median of its rounds), and the
verdict is the median's:

    python -m benchmarks.lookup.targets RUN1.json RUN2.json RUN3.json

(each a benchmarks/results/lookup-*.json of the same command; runs of other tables,
batches or threads are refused).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .. import common
from .names import BATCHED, COLLECTION, FBGEMM

ZIPF_LINE, UNIFORM_LINE, EBC_LINE, SCALING_LINE = 1.0, 0.8, 1.0, 1.7
SCALING_THREADS = (2, 1)  # the issue's line: 2 threads against 1
# Parameters that change a set's tables or batches (a set's label names its dtype, dim and init).
SAME_IN_EVERY_RUN = ("scale", "batches", "seed", "threads", "trained_tables")


class NotARun(ValueError):
    """A JSON that is not a lookup benchmark run this module can read."""


def _thread_twin(name: str) -> str | None:
    """'B4096 P20 Zipf 1.05 @2 thr' -> 'B4096 P20 Zipf 1.05' (None for a workload at --threads)."""
    return name.split(" @")[0] if " @" in name else None


def run_ratios(doc: dict) -> dict:
    """{(table set, workload): {"lookup_many", "ebc", "zipf", "scaling"}} of one lookup
    benchmark run, for the workloads that have an FBGEMM pair; "scaling" is None or
    (threads, twin's threads, lookup_many's speedup, FBGEMM's speedup)."""
    out = {}
    try:
        for r in doc["results"]:
            by_name = {w["workload"]: w for w in r["workloads"]}
            for name, w in by_name.items():
                ratios = w.get("ibp_vs_fbgemm_throughput_ratios") or {}
                if ratios.get(BATCHED) is None:
                    continue
                scaling = None
                one = by_name.get(_thread_twin(name))
                if one is not None:
                    def speedup(system):
                        return w["systems"][system]["lookups_per_s"] / one["systems"][system]["lookups_per_s"]
                    scaling = (w["threads"], one["threads"], speedup(BATCHED), speedup(FBGEMM))
                out[(r["label"], name)] = {"lookup_many": ratios[BATCHED], "ebc": ratios.get(COLLECTION),
                                           "zipf": w["alpha"] is not None, "scaling": scaling}
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise NotARun(f"run {doc.get('params', {}).get('started_utc', '?')}: a result lacks a field this "
                      f"report reads ({type(e).__name__}: {e})") from e
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def combine(docs: list[dict]) -> dict:
    """The targets over several runs of the same benchmark: each value the median of the runs'."""
    if not docs:
        raise ValueError("no runs to judge")
    params = [d.get("params") or {} for d in docs]
    for p in params[1:]:
        diff = [k for k in SAME_IN_EVERY_RUN if p.get(k) != params[0].get(k)]
        if diff:
            raise ValueError(f"runs {params[0].get('started_utc')} and {p.get('started_utc')} differ in "
                             f"{', '.join(diff)}: their ratios are not of the same tables, batches and threads")
    per_run = [run_ratios(d) for d in docs]
    for p, got in zip(params, per_run):
        if not got:
            raise NotARun(f"run {p.get('started_utc', '?')} has no `lookup_many` ratio against FBGEMM's TBE "
                          "(runs before 2026-12-02 did not time it, bf16-only runs have no pair)")
    keys = [k for k in per_run[0] if all(k in p for p in per_run[1:])]
    left_out = sorted({k for p in per_run for k in p} - set(keys))
    rows = []
    for key in keys:
        got = [p[key] for p in per_run]
        lm = [g["lookup_many"] for g in got]
        ebc = [g["ebc"] for g in got]
        line = ZIPF_LINE if got[0]["zipf"] else UNIFORM_LINE
        row = {"table_set": key[0], "workload": key[1], "lookup_many": _median(lm), "lookup_many_runs": lm,
               "lookup_many_line": line, "ebc": _median(ebc), "ebc_runs": ebc, "ebc_line": EBC_LINE}
        row["lookup_many_met"] = row["lookup_many"] >= line
        row["ebc_met"] = None if row["ebc"] is None else row["ebc"] >= EBC_LINE
        scalings = [g["scaling"] for g in got]
        if all(s is not None for s in scalings):
            ibp, fb = _median([s[2] for s in scalings]), _median([s[3] for s in scalings])
            judged = scalings[0][:2] == SCALING_THREADS
            row["scaling"] = {"threads": scalings[0][0], "against_threads": scalings[0][1],
                              "lookup_many": ibp, "lookup_many_runs": [s[2] for s in scalings],
                              "fbgemm": fb, "fbgemm_runs": [s[3] for s in scalings], "line": SCALING_LINE,
                              "required": judged and fb >= SCALING_LINE,
                              "met": (ibp >= SCALING_LINE or fb < SCALING_LINE) if judged else None}
        rows.append(row)
    count = {name: [sum(r[f"{name}_met"] is True for r in rows), sum(r[f"{name}_met"] is not None for r in rows)]
             for name in ("lookup_many", "ebc")}
    return {"runs": [p.get("started_utc") or "?" for p in params],
            "commits": sorted({p.get("machine", {}).get("git_commit") or "?" for p in params}),
            "cpu_models": sorted({p.get("machine", {}).get("cpu_model") or "?" for p in params}),
            "rows": rows, "met": count, "left_out": [list(k) for k in left_out]}


def _runs(xs):
    return ", ".join("-" if x is None else f"{x:.2f}" for x in xs)


def format_issue11(t: dict) -> str:
    n = len(t["runs"])
    L = [f"### Issue 11's targets, the median of {n} run{'s' if n > 1 else ''} ({', '.join(t['runs'])}; "
         f"{', '.join(c[:7] for c in t['commits'])}; {', '.join(t['cpu_models'])})", ""]
    heads = ["table set", "workload", "lookup_many / FBGEMM", "line", "verdict", "IBP EBC / fused EBC", "verdict"]
    if n > 1:
        heads[3:3] = ["lookup_many runs"]
        heads.append("EBC runs")
    body = []
    for r in t["rows"]:
        cells = [r["table_set"], r["workload"], f"{r['lookup_many']:.2f}x", f"{r['lookup_many_line']:.1f}x",
                 "met" if r["lookup_many_met"] else "MISSED",
                 "-" if r["ebc"] is None else f"{r['ebc']:.2f}x",
                 "" if r["ebc_met"] is None else "met" if r["ebc_met"] else "MISSED"]
        if n > 1:
            cells[3:3] = [_runs(r["lookup_many_runs"])]
            cells.append(_runs(r["ebc_runs"]))
        body.append(cells)
    L += [common.markdown_table(heads, body), ""]
    m = t["met"]
    L.append(f"Met: `lookup_many` {m['lookup_many'][0]} of {m['lookup_many'][1]}, the collection "
             f"{m['ebc'][0]} of {m['ebc'][1]} (workloads on more threads included).")
    if t["left_out"]:
        L.append("Left out, not in every run: " + "; ".join(f"{s}, {w}" for s, w in t["left_out"]) + ".")
    for r in t["rows"]:
        s = r.get("scaling")
        if s:
            if s["met"] is None:
                verdict = f"not judged (the line is for {SCALING_THREADS[0]} threads against {SCALING_THREADS[1]})"
            elif not s["required"]:
                verdict = f"not required (FBGEMM below {s['line']:.1f}x)"
            else:
                verdict = "met" if s["met"] else "MISSED"
            runs = f" (runs {_runs(s['lookup_many_runs'])}; {_runs(s['fbgemm_runs'])})" if n > 1 else ""
            L.append(f"Threads ({r['table_set']}, {r['workload']}): `lookup_many` on {s['threads']} threads "
                     f"{s['lookup_many']:.2f}x its speed on {s['against_threads']}, FBGEMM's TBE {s['fbgemm']:.2f}x"
                     f"{runs}; {s['line']:.1f}x: {verdict}.")
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lookup.targets",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="lookup benchmark JSONs (benchmarks/results/lookup-*.json)")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    p.add_argument("--no-json", action="store_true", help="print the table only")
    a = p.parse_args(argv)
    docs = []
    for path in a.runs:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            p.error(f"{path}: {e}")
        if not isinstance(doc, dict) or doc.get("benchmark") != "lookup" or "results" not in doc:
            p.error(f"{path} is not a lookup benchmark run (benchmarks/results/lookup-*.json)")
        docs.append(doc)
    try:
        t = combine(docs)
    except ValueError as e:
        p.error(str(e))
    text = format_issue11(t)
    print(text)
    if not a.no_json:
        path = common.write_json({"benchmark": "lookup_targets", "sources": [str(x) for x in a.runs], **t,
                                  "markdown": text}, "lookup_targets", results_dir=a.results_dir)
        print(f"\nresults: {common.shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Rewrite-only before/after over the corpus: which rows' rewrite changed between two checkouts.

    python benchmarks/realworld/rewrite_diff.py --mirrors DIR --old CHECKOUT [--new CHECKOUT] [--only ID]

Each script of the manifests (twins share their row's rewrite and are left out) is laid out as
run.py lays it out (its extra_files, patches and stubs, with run.py's own functions), then
rewritten with each checkout's code (`python -m fsdp2_retrofit rewrite SRC -o DIR/ --report json
--no-cache`), once with the default options and once with --keep-global-batch (what verify
applies). A row differs when the exit code, the refusal code or any written file's bytes differ.
Writes a JSON list of rows (--json) and prints one line per row that differs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run  # noqa: E402  (the corpus runner: manifests, mirrors, extraction)


def lay_out(script: run.Script, mirrors: Path, into: Path) -> Path:
    """The script and its extra files, patched and stubbed, as run.run_one lays them out."""
    return run.lay_out(script, run.git_dir(mirrors, script.repo), into)


def rewrite(code: Path, python: str, src: Path, out: Path, extra: list) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code))
    proc = subprocess.run([python, "-m", "fsdp2_retrofit", "rewrite", str(src), "-o", str(out) + os.sep,
                           "--report", "json", "--no-cache", *extra], cwd=code, env=env,
                          capture_output=True, text=True, timeout=600)
    report = run._json_or_none(proc.stdout) or []
    refusals = [r for entry in report for r in (entry.get("refusals") or [])]
    files = {str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()}
    return {"exit": proc.returncode, "refusal": refusals[0].get("code") if refusals else None,
            "refusal_line": refusals[0].get("line") if refusals else None,
            "refusal_what": refusals[0].get("what") if refusals else None,
            "changed": [entry.get("path") for entry in report if entry.get("changed")],
            "files": files, "stderr": proc.stderr[-400:] if proc.returncode not in (0, 2) or not report else ""}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mirrors", type=Path, required=True)
    ap.add_argument("--old", type=Path, required=True, help="checkout of the old code")
    ap.add_argument("--new", type=Path, default=HERE.parents[1], help="checkout of the new code (default: this one)")
    ap.add_argument("--python", default=sys.executable, help="interpreter with the tool's dependencies")
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--results", type=Path, default=HERE / "results" / "results.json")
    opts = ap.parse_args()
    scripts = run.load_manifests(HERE / "manifest")
    if opts.only:
        scripts = [s for s in scripts if any(s.id == o or s.id.startswith(o) for o in opts.only)]
    recorded = {}
    if opts.results.is_file():
        recorded = {r["id"]: r for r in json.loads(opts.results.read_text(encoding="utf-8"))["scripts"]}
    rows = []
    for s in scripts:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            row = {"id": s.id, "old_verdict": (recorded.get(s.id) or {}).get("verdict")}
            try:
                src = lay_out(s, opts.mirrors, tmp / "src")
            except run.RecipeError as exc:
                row["error"] = str(exc)
                rows.append(row)
                print(f"{s.id}: RECIPE {exc}", flush=True)
                continue
            differs = []
            for mode, extra in (("default", []), ("keep-global-batch", ["--keep-global-batch"])):
                res = {}
                for side, code in (("old", opts.old), ("new", opts.new)):
                    res[side] = rewrite(code.resolve(), opts.python, src, tmp / f"{side}-{mode}", extra)
                old, new = res["old"], res["new"]
                what = []
                if old["exit"] != new["exit"]:
                    what.append(f"exit {old['exit']} -> {new['exit']}")
                if old["refusal"] != new["refusal"]:
                    what.append(f"refusal {old['refusal']} -> {new['refusal']}")
                names = sorted(set(old["files"]) | set(new["files"]))
                bytes_differ = [n for n in names if old["files"].get(n) != new["files"].get(n)]
                if bytes_differ:
                    what.append("bytes differ: " + ", ".join(bytes_differ))
                row[mode] = {
                    "old": {k: v for k, v in old.items() if k != "files"} | {"written": sorted(old["files"])},
                    "new": {k: v for k, v in new.items() if k != "files"} | {"written": sorted(new["files"])},
                    "differs": what,
                }
                if what:
                    differs.append(f"[{mode}] " + "; ".join(what))
            row["differs"] = differs
            rows.append(row)
            d = row["default"]
            print(f"{s.id}: {'DIFFERS ' + ' | '.join(differs) if differs else 'same'}"
                  f" (old {row['old_verdict']}, refusal {d['old']['refusal']} -> {d['new']['refusal']},"
                  f" new writes {d['new']['written']})", flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    n = sum(1 for r in rows if r.get("differs"))
    print(f"{len(rows)} rows, {n} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

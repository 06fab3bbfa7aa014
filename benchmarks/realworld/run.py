"""Run the real-world corpus: rewrite, check and verify public training scripts read from git mirrors.

    python benchmarks/realworld/run.py --mirrors DIR [--only ID] [--jobs N] [--python PY]

See README.md beside this file (manifest schema, data kinds, verdicts). This
process never imports torch: the rewrite, check and verify steps run as
``python -m fsdp2_retrofit`` children with this repository first on their
path; the scripts themselves run with ``--python``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from fsdp2_retrofit.verify import processes  # noqa: E402  (no torch: the run's processes, killed as a whole)

SHIM = HERE / "shim"
DATA_SCRIPT = HERE / "data.py"
VERDICTS = ("parity", "trains", "flagged", "refused", "crash", "silently-wrong")

DEFAULTS = {
    "extra_files": [], "data": [], "args": [], "per_rank_args": [], "steps": 5, "compare": "parity",
    "tolerance": 1e-4, "noise_rtol": 0.1, "seed": 0, "timeout": 300, "env": {}, "patches": [], "notes": "",
    "split_data": None, "stubs": {}, "pythonpath": [], "to_end": True, "twin": True,
    "refusal": "", "refusal_code": "", "twin_native": "",
}
KEYS = set(DEFAULTS) | {"id", "path"}
TWIN = "~det"  # a `trains` row's deterministic twin: its id is the row's plus this
TWIN_ENV = {"REALWORLD_DETERMINISTIC": "1"}
TWIN_DTYPE = "float64"  # verify --dtype of a twin: round-off ~1e-16, which no optimizer amplifies into steps
JUDGEMENTS = ("justified", "avoidable")  # a refused row: would an FSDP2 engineer agree with the refusal?


def twins(scripts: List["Script"]) -> List["Script"]:
    """Each `trains` row followed by its deterministic twin: the same recipe with the shim's
    REALWORLD_DETERMINISTIC (dropout off, noise drawn for the global batch and sliced, items
    seeded by index, one seed on every rank), both runs made in float64 (verify --dtype float64)
    unless the manifest's `twin_native` says why the script cannot run so. The twin should reach
    parity; where it only trains, what is left random (or per rank) is what keeps the row from parity."""
    out = []
    for s in scripts:
        out.append(s)
        if s.compare == "trains" and s.spec.get("twin", True):
            spec = dict(s.spec, env=dict(s.spec["env"], **TWIN_ENV),
                        dtype="native" if s.spec.get("twin_native") else TWIN_DTYPE)
            out.append(Script(s.repo, s.commit, s.id + TWIN, s.path, spec, s.manifest))
    return out


class RecipeError(Exception):
    """The manifest or the mirrors cannot give what a script needs (the harness's problem, not the tool's)."""


@dataclass
class Script:
    repo: str
    commit: str
    id: str
    path: str
    spec: dict
    manifest: str

    def __getattr__(self, name):
        try:
            return self.__dict__["spec"][name]
        except KeyError:
            raise AttributeError(name) from None


def load_manifests(directory: Path) -> List[Script]:
    scripts: List[Script] = []
    seen: Dict[str, str] = {}
    for path in sorted(directory.glob("*.toml")):
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        repo = data.get("repo") or {}
        name, commit = repo.get("name"), repo.get("commit")
        if not name or not re.fullmatch(r"[0-9a-f]{40}", commit or ""):
            raise SystemExit(f"{path}: [repo] needs name and a 40-hex commit")
        defaults = dict(DEFAULTS, **data.get("defaults", {}))
        for entry in data.get("script", []):
            unknown = set(entry) - KEYS
            if unknown:
                raise SystemExit(f"{path}: script {entry.get('id')}: unknown keys {sorted(unknown)}")
            if "id" not in entry or "path" not in entry:
                raise SystemExit(f"{path}: every [[script]] needs id and path")
            if entry["id"] in seen:
                raise SystemExit(f"{path}: id {entry['id']} also in {seen[entry['id']]}")
            seen[entry["id"]] = path.name
            spec = dict(defaults, **entry)
            if spec["split_data"] is None:
                spec["split_data"] = bool(spec["data"])
            if not isinstance(spec["twin_native"], str):
                raise SystemExit(f"{path}: {entry['id']}: twin_native is the reason (a string) the twin "
                                 f"cannot run in {TWIN_DTYPE}")
            if spec["compare"] not in ("parity", "trains"):
                raise SystemExit(f"{path}: {entry['id']}: compare must be parity or trains")
            if spec["refusal"] or spec["refusal_code"]:
                kind, _, why = spec["refusal"].partition(":")
                if kind not in JUDGEMENTS or not why.strip() or not re.fullmatch(r"FS[RD]\d{3}", spec["refusal_code"]):
                    raise SystemExit(f"{path}: {entry['id']}: refusal must read 'justified: <why>' or "
                                     f"'avoidable: <why>', with refusal_code the code it judges (FSR605)")
            scripts.append(Script(name, commit, entry["id"], entry["path"], spec, path.name))
    return scripts


# -- mirrors ----------------------------------------------------------------------


def git_dir(mirrors: Path, repo: str) -> Path:
    base = mirrors / repo.replace("/", "+")
    for candidate in (base / "repo", base / "repo" / ".git", base, base / ".git"):
        if (candidate / "objects").is_dir() and (candidate / "HEAD").is_file():
            return candidate
    raise RecipeError(f"no mirror of {repo} under {mirrors} (expected {base}/repo, a bare git repository)")


def git(gdir: Path, *args: str) -> bytes:
    proc = subprocess.run(["git", f"--git-dir={gdir}", *args], capture_output=True)
    if proc.returncode != 0:
        raise RecipeError(f"git {' '.join(args)}: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout


def extract(gdir: Path, commit: str, path: str, into: Path) -> None:
    if path.endswith("/"):
        # blobs only: a submodule (a gitlink, type `commit`) has no content in this repository
        names = [line.split("\t", 1)[1] for line in git(gdir, "ls-tree", "-r", commit, "--", path).decode().splitlines()
                 if line.split()[1] == "blob"]
        if not names:
            raise RecipeError(f"{path}: no files at {commit[:12]}")
        for name in names:
            extract(gdir, commit, name, into)
        return
    target = into / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(git(gdir, "show", f"{commit}:{path}"))


# -- the steps ----------------------------------------------------------------------


def tool(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m fsdp2_retrofit ...` with this repository's code (cwd = the repository root)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "fsdp2_retrofit", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


_EXC = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception|Interrupt|Exit)\b.*)$")


def first_error_line(text: str) -> str:
    """The first exception line of a traceback (not torchrun's banner), else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines()]
    for ln in lines:
        if ln.startswith("exceptions:"):
            continue
        m = _EXC.match(ln)
        if m and not m.group(1).startswith(("torch.distributed.elastic", "ChildFailedError")):
            return m.group(1)[:300]
    rest = [ln for ln in lines if ln]
    return rest[-1][:300] if rest else ""


def rewrite_step(src: Path, out: Path) -> dict:
    """Rewrite `src` into the folder of `out` (the script at `out`, the project modules the
    rewrite also edits beside it at their paths below the script's folder), then compile the
    output and check its idempotence and lint findings."""
    res: dict = {"exit_code": None, "refusal": None, "compiles": None, "idempotent": None, "check": None,
                 "error": None}
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = tool("rewrite", str(src), "-o", str(out.parent) + os.sep, "--report", "json", "--no-cache")
    res["exit_code"] = proc.returncode
    report = _json_or_none(proc.stdout)
    refusals = (report or [{}])[0].get("refusals") if report else None
    # what the report says will not train like the original (attention items marked `differs`), in every file
    res["differs"] = [{"line": a.get("line"), "what": a.get("what")}
                      for entry in report or [] for a in (entry.get("attention") or []) if a.get("differs")]
    res["files"] = [entry.get("path") for entry in report or [] if entry.get("changed")]
    # `-o DIR` lays the set out below the folder its files share (workspace.project_relative):
    # the script is at `out` only where every edited file is in the script's folder or below it
    base = Path(os.path.commonpath([str(src.parent.resolve())] + [
        str(Path(f).resolve().parent) for f in res["files"] if f]))
    written = out.parent  # the -o folder
    out = written / src.resolve().relative_to(base)
    out.parent.mkdir(parents=True, exist_ok=True)
    if refusals:
        r = refusals[0]
        res["refusal"] = {"code": r.get("code"), "line": r.get("line"), "what": r.get("what"), "why": r.get("why")}
        return res
    if proc.returncode != 0:
        res["error"] = first_error_line(proc.stderr) or f"exit code {proc.returncode}"
        return res
    if not out.is_file():  # nothing to change: the output is the input
        out.write_bytes(src.read_bytes())
    try:
        compile(out.read_bytes(), str(out), "exec")
        res["compiles"] = True
    except SyntaxError as exc:
        res["compiles"] = False
        res["error"] = f"output does not compile: {exc.msg} (line {exc.lineno})"
        return res
    # the output is rewritten again and checked where the script is, beside its own modules
    # (`from models import *` is read from the files next to it), under a name no import can reach;
    # where the rewrite edited modules beside it, in a copy of the script's folder holding the edited ones
    edited = [f for f in written.rglob("*.py") if f != out]
    folder = src.parent
    if edited:
        project = written.parent / "project"
        shutil.rmtree(project, ignore_errors=True)
        shutil.copytree(base, project)
        for f in edited:
            shutil.copyfile(f, project / f.relative_to(written))
        folder = project / src.resolve().parent.relative_to(base)
    beside = folder / (src.stem + ".retrofit" + src.suffix)
    beside.write_bytes(out.read_bytes())
    try:
        res = _check_output(beside, res)
    finally:
        beside.unlink(missing_ok=True)
    # the output's own check against the report: each finding should be an attention item ("FSD120: ...")
    said = {a.get("what", "").split(":", 1)[0] for entry in report or [] for a in (entry.get("attention") or [])}
    res["check_unreported"] = [c for c in res.get("check") or [] if c.startswith("FSD") and c not in said]
    return res


def _check_output(out: Path, res: dict) -> dict:
    """Idempotence and `check` findings of a rewritten script (rewrite_step's last part)."""
    again = tool("rewrite", str(out), "--check", "--report", "json", "--no-cache")
    res["idempotent"] = again.returncode == 0
    if again.returncode == 2:
        rep = _json_or_none(again.stdout)
        ref = (rep or [{}])[0].get("refusals") if rep else None
        res["idempotent_note"] = (f"rewriting the output is refused: {ref[0].get('code')} {ref[0].get('what')}"
                                  if ref else first_error_line(again.stderr))
    chk = tool("check", str(out), "--output-format", "json", "--exit-zero")
    findings = _json_or_none(chk.stdout)
    if isinstance(findings, list):
        res["check"] = sorted({f.get("code") or f.get("rule") or "?" for f in findings})
    else:
        res["check"] = [f"check failed: {first_error_line(chk.stderr)}"]
    return res


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


def place_data(script: Script, gdir: Path, work: Path, python: str) -> Optional[Path]:
    """Write the synthetic inputs; returns the run-files directory when some go inside the run directories."""
    run_cwd = work / "r" / "runs" / "single"
    files = work / "files"
    specs = []
    for entry in script.data:
        at = entry["at"]
        if at.startswith(".."):
            target = (run_cwd / at).resolve()
            if work.resolve() not in target.parents and target != work.resolve():
                raise RecipeError(f"data at {at!r} resolves outside {work}")
        else:
            target = (files / at).resolve()
        if entry["kind"] == "copy":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(git(gdir, "show", f"{script.commit}:{entry['from']}"))
            continue
        specs.append(dict(entry, path=str(target), src=str(work / "src")))
    if specs:
        spec_file = work / "data.json"
        spec_file.write_text(json.dumps(specs), encoding="utf-8")
        proc = subprocess.run([python, str(DATA_SCRIPT), str(spec_file)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RecipeError(f"writing the synthetic data failed: {first_error_line(proc.stderr)}")
    return files if files.is_dir() else None


def verify_step(script: Script, src: Path, work: Path, run_files: Optional[Path], python: str) -> dict:
    report = work / "verify.json"
    keep = work / "r" / "runs"
    args = ["verify", str(src), "--json", str(report), "--steps", str(script.steps), "--python", python,
            "--keep-runs", str(keep), "--timeout", str(script.timeout), "--tolerance", str(script.tolerance)]
    if run_files is not None:
        args += ["--run-files", str(run_files)]
    if script.to_end:
        args.append("--to-end")
    if script.spec.get("dtype", "native") != "native":
        args += ["--dtype", script.spec["dtype"]]
    for name in script.per_rank_args:
        args += ["--per-rank-arg", name]
    args += ["--", *script.args]
    env = dict(os.environ)
    repo_root = src.parents[len(Path(script.path).parts) - 1]  # where the extraction puts the repository's root
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), *(str((repo_root / p).resolve()) for p in script.pythonpath)])
    env["REALWORLD_SKIP_INTEGRITY"] = "1"
    if script.seed is not False:
        env["REALWORLD_SEED"] = str(int(script.seed))
    env.update({k: str(v) for k, v in script.env.items()})
    # every process verify starts inherits the mark: on the harness's timeout (verify's own did not
    # fire) or any other way out, none of them outlives this step, torchrun's ranks included
    env, tag = processes.marked(env)
    try:
        proc = subprocess.run([sys.executable, "-m", "fsdp2_retrofit", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=3 * script.timeout + 120,
                              start_new_session=True)
    finally:
        processes.kill_run(None, tag)
    data = _json_or_none(report.read_text(encoding="utf-8")) if report.is_file() else None
    if data is None:
        data = {"exit_code": proc.returncode, "error": first_error_line(proc.stderr) or "verify wrote no report",
                "detail": proc.stderr[-4000:]}
    return data


def judge(script: Script, rw: dict, vf: Optional[dict]) -> tuple:
    """(verdict, detail, first error line)."""
    verdict, detail, error = _judge(script, rw, vf)
    said = "; ".join(f"line {d['line']}: {d['what']}" for d in rw.get("differs") or [])
    if verdict == "silently-wrong" and said:
        # not silent: the report named what differs, and where
        return "flagged", f"the report says: {said} -- measured: {detail}", ""
    if verdict == "trains" and script.id.endswith(TWIN):
        # what keeps a deterministic twin from parity: what verify measured first (the report's
        # differs items, BatchNorm per rank on CPU, are what the shim's synchronised BatchNorm removes)
        return verdict, f"not at parity: {(vf or {}).get('summary')}; {detail}", error
    return verdict, detail, error


def _judge(script: Script, rw: dict, vf: Optional[dict]) -> tuple:
    if rw.get("refusal"):
        r = rw["refusal"]
        return "refused", f"{r['code']} line {r['line']}: {r['what']}: {r['why']}", ""
    if rw.get("error"):
        return "crash", f"rewrite: {rw['error']}", rw["error"]
    if vf is None:
        return "crash", "verify did not run", ""
    if vf.get("exit_code") == 2 and "error" in vf:
        message, detail = vf["error"], vf.get("detail") or ""
        if "cannot retrofit" in message:
            return "refused", message, ""
        err = first_error_line(detail) or message
        if "single-process run" in message:
            return "crash", f"RECIPE: the original itself failed in one process: {message}", err
        return "crash", message, err
    notes = "; ".join(vf.get("notes") or [])
    rank_w = vf.get("rank_weights") or {}
    if rank_w and not rank_w.get("ok"):
        return "silently-wrong", f"ranks hold different weights: {rank_w.get('problem')}", ""
    initial = vf.get("initial_weights") or {}
    if initial and not initial.get("ok"):
        return ("silently-wrong", f"the ranks did not start from the single run's weights: {initial.get('problem')}",
                "")
    if script.split_data and vf.get("same_data_on_every_rank"):
        return "silently-wrong", "data not split: every rank recorded the same loss at every step", ""
    if vf.get("epilogue"):
        return "crash", f"after training (verify --to-end): {vf['epilogue']}", vf["epilogue"]
    if vf.get("global_batch"):
        # not a training defect verify saw: the retrofit trains on another global batch than the
        # single run (--keep-global-batch not applied to a batch size); the report may say so
        return "silently-wrong", f"global batch not kept: {vf['global_batch']}", ""
    if vf.get("equivalent"):
        return "parity", vf.get("summary", ""), ""
    noise = vf.get("within_noise") or {}
    weights = vf.get("weights") or {}
    if script.compare == "trains":
        if noise.get("ok") and (not weights or weights.get("max_abs_diff") is not None):
            return "trains", f"not step-equal (random draws differ); {noise.get('why')}", ""
        return "silently-wrong", f"beyond noise: {noise.get('why')}; {vf.get('summary')}", ""
    return "silently-wrong", f"{vf.get('summary')}" + (f" ({notes})" if notes else ""), ""


def lay_out(script: Script, gdir: Path, src_root: Path) -> Path:
    """The script and its extra files extracted under src_root, patched and stubbed; its path there."""
    for path in [script.path, *script.extra_files]:
        extract(gdir, script.commit, path, src_root)
    src = src_root / script.path
    for patch in script.patches:
        target = src_root / patch.get("file", script.path)
        text = target.read_text(encoding="utf-8")
        if text.count(patch["find"]) != 1:
            raise RecipeError(f"patch {patch['find'][:40]!r}: found {text.count(patch['find'])} times")
        target.write_text(text.replace(patch["find"], patch["replace"]), encoding="utf-8")
    for module, code in script.stubs.items():  # a dotted name becomes packages with empty __init__.py
        parts = module.split(".")
        folder = src.parent
        for part in parts[:-1]:
            folder = folder / part
            folder.mkdir(exist_ok=True)
            (folder / "__init__.py").touch()
        (folder / f"{parts[-1]}.py").write_text(code, encoding="utf-8")
    return src


def run_one(script: Script, mirrors: Path, work_root: Path, python: str) -> dict:
    started = time.time()
    work = work_root / script.id
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    src_root = work / "src"
    row = {"id": script.id, "repo": script.repo, "commit": script.commit, "path": script.path,
           "compare": script.compare, "steps": script.steps, "patches": [p.get("why", "") for p in script.patches] + [f"stub module {m}" for m in script.stubs],
           "notes": script.notes, "rewrite": None, "verify": None, "dtype": script.spec.get("dtype", "native")}
    if script.id.endswith(TWIN) and script.twin_native:
        row["dtype_note"] = f"twin not in {TWIN_DTYPE}: {script.twin_native}"
    try:
        gdir = git_dir(mirrors, script.repo)
        src = lay_out(script, gdir, src_root)
        rw = rewrite_step(src, work / "rewritten" / src.name)
        row["rewrite"] = rw
        vf = None
        if not rw.get("refusal") and not rw.get("error"):
            run_files = place_data(script, gdir, work, python)
            vf = verify_step(script, src, work, run_files, python)
            row["verify"] = {k: vf.get(k) for k in ("exit_code", "equivalent", "summary", "error", "max_loss_diff",
                                                      "first_diverging_step", "weights", "rank_weights", "initial_weights",
                                                      "same_data_on_every_rank", "within_noise", "notes")}
            row["verify"]["steps_recorded"] = len(vf.get("steps") or [])
            row["verify"]["losses"] = [[s.get("loss_single"), s.get("loss_dist")] for s in vf.get("steps") or []]
            if vf.get("detail"):
                row["verify"]["detail"] = vf["detail"][-2000:]
        verdict, detail, error = judge(script, rw, vf)
    except RecipeError as exc:
        verdict, detail, error = "crash", f"RECIPE: {exc}", str(exc)
    except subprocess.TimeoutExpired as exc:
        verdict, detail, error = "crash", f"the harness timed out ({exc.timeout:.0f} s)", "timeout"
    # paths under this checkout read the same from any checkout (a worktree, CI's clone)
    detail = detail.replace(f"{work_root}/", "work/").replace(f"{ROOT}/", "")
    row.update(verdict=verdict, detail=detail, first_error=error, seconds=round(time.time() - started, 1))
    return row


# -- refusal judgements ----------------------------------------------------------------


def refusal_code(row: dict) -> Optional[str]:
    """The code of a refused row's refusal: the rewrite's, else the one verify's message names."""
    refusal = (row.get("rewrite") or {}).get("refusal") or {}
    if refusal.get("code"):
        return refusal["code"]
    m = re.search(r"\b(FS[RD]\d{3})\b", row.get("detail") or "")
    return m.group(1) if m else None


def refusal_judgement(script: Optional[Script], row: dict) -> Optional[dict]:
    """What the manifest says of a refused row (`refusal`, checked against `refusal_code`):
    status `justified` or `avoidable` when it judges the refusal the rewrite gives now;
    `unjudged` when it says nothing; `stale` when it judged another refusal (or the rewrite no
    longer refuses): a changed refusal must be judged again."""
    given = (script.spec.get("refusal") or "") if script is not None else ""
    judged = (script.spec.get("refusal_code") or "") if script is not None else ""
    kind, _, why = given.partition(":")
    if row.get("verdict") != "refused":
        if not given:
            return None
        return {"status": "stale", "code": None, "judged_code": judged, "kind": kind, "why": why.strip()}
    code = refusal_code(row)
    if not given:
        return {"status": "unjudged", "code": code}
    if judged != code:
        return {"status": "stale", "code": code, "judged_code": judged, "kind": kind, "why": why.strip()}
    return {"status": kind, "code": code, "why": why.strip()}


def judgement_cell(judgement: Optional[dict]) -> str:
    if not judgement:
        return "-"
    status = judgement["status"]
    if status in JUDGEMENTS:
        return f"{status}: {judgement['why']}"
    if status == "unjudged":
        return "NOT JUDGED"
    now = judgement["code"] or "no refusal"
    return f"RE-JUDGE: judged {judgement['judged_code']} ({judgement['kind']}), now {now}"


def attach_judgements(rows: List[dict], scripts: List[Script]) -> None:
    """Every row's refusal judgement from the manifests as they are now (rows merged from an
    earlier run included, so a judgement edited in a manifest shows without rerunning its row)."""
    by_id = {s.id: s for s in scripts}
    for r in rows:
        r["refusal_judgement"] = refusal_judgement(by_id.get(r.get("id")), r)


# -- output ------------------------------------------------------------------------


def summary_line(rows: List[dict]) -> str:
    own = [r for r in rows if not r.get("id", "").endswith(TWIN)]
    count = {v: sum(1 for r in own if r["verdict"] == v) for v in VERDICTS}
    line = (f"{len(own)} scripts: {count['parity']} parity, {count['trains']} trains, {count['flagged']} flagged, "
            f"{count['refused']} refused, "
            f"{count['crash']} crash, {count['silently-wrong']} silently-wrong")
    refused = [r for r in own if r["verdict"] == "refused"]
    judged = {s: sum(1 for r in refused if (r.get("refusal_judgement") or {}).get("status") == s)
              for s in JUDGEMENTS}
    part = ""
    if any(r.get("refusal_judgement") for r in refused):
        left = len(refused) - sum(judged.values())
        part = (f"; refusals judged: {judged['avoidable']} avoidable, {judged['justified']} justified"
                + (f", {left} not judged or stale" if left else ""))
    ran = {r.get("id") for r in own if r["verdict"] not in ("refused", "crash")}
    # a refused or crashed row's twin is refused or crashed too: it says nothing about determinism
    twin = {r["id"][: -len(TWIN)]: r for r in rows if r.get("id", "").endswith(TWIN) and r["id"][: -len(TWIN)] in ran}
    if not twin:
        return line + part
    # a twin measured in float64 (verify --dtype float64) or in the script's own dtypes (twin_native, or a
    # row kept from a run before the twins were float64): the count in float64 is said
    f64 = sum(1 for r in twin.values() if r.get("dtype") == TWIN_DTYPE)
    at_parity = [r for r in own if r["verdict"] == "parity" or twin.get(r.get("id"), {}).get("verdict") == "parity"]
    runnable = [r for r in own if r["verdict"] in ("parity", "trains", "flagged", "silently-wrong")]
    wrong = sum(1 for r in twin.values() if r["verdict"] == "silently-wrong")
    return (line + f"; deterministic twins of the trains rows: {sum(1 for r in twin.values() if r['verdict'] == 'parity')}"
            f"/{len(twin)} parity" + (f", {wrong} silently-wrong" if wrong else "") + f" ({f64} in {TWIN_DTYPE})"
            + f"; at parity (as given or by the twin): {len(at_parity)}/{len(runnable)} runnable scripts"
            + (f" ({100 * len(at_parity) / len(runnable):.0f}%)" if runnable else "") + part)


def _cell(text, limit: int = 220) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")[:limit]


def markdown(rows: List[dict]) -> str:
    out = ["# Real-world corpus results", "",
           "Generated by `benchmarks/realworld/run.py`; see README.md for the verdicts.", "",
           summary_line(rows), "",
           "| id | repo:path | verdict | detail | refusal judged | rewrite ok / idempotent / check | steps | max weight diff | first error | patches |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rw = r.get("rewrite") or {}
        if rw.get("refusal"):
            rw_cell = f"refused ({rw['refusal']['code']})"
        elif rw.get("error"):
            rw_cell = "error"
        elif rw:
            check = ",".join(c + (" (not in the report)" if c in (rw.get("check_unreported") or []) else "")
                             for c in rw.get("check") or []) or "none"
            rw_cell = (f"{'ok' if rw.get('compiles') else 'no'} / {'yes' if rw.get('idempotent') else 'NO'} / "
                       f"{check}")
        else:
            rw_cell = "-"
        vf = r.get("verify") or {}
        weights = vf.get("weights") or {}
        diff = weights.get("max_abs_diff")
        steps = f"{vf.get('steps_recorded', 0)}/{r['steps']}" if vf else f"-/{r['steps']}"
        dtype = f" ({r['dtype']})" if r.get("dtype", "native") != "native" else ""
        out.append(f"| {r['id']}{dtype} | {_cell(r['repo'].split('/')[1] + ':' + r['path'])} | **{r['verdict']}** | "
                   f"{_cell(r['detail'])} | {_cell(judgement_cell(r.get('refusal_judgement')), 500)} | {_cell(rw_cell)} | {steps} | "
                   f"{'-' if diff is None else f'{diff:.2e}'} | {_cell(r['first_error'])} | "
                   f"{_cell('; '.join(r['patches']))} |")
    out += ["", summary_line(rows), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirrors", type=Path, required=True, help="directory of mirrors: OWNER+NAME/repo")
    parser.add_argument("--only", action="append", default=[], help="an id, or an id prefix (repeatable)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the scripts")
    parser.add_argument("--manifest", type=Path, default=HERE / "manifest")
    parser.add_argument("--work", type=Path, default=HERE / "work")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--no-twins", action="store_true",
                        help="skip the deterministic twins of the trains rows (id~det)")
    opts = parser.parse_args(argv)

    # read once, at the start: a manifest edited while the corpus runs must not stop the results being written
    manifests = twins(load_manifests(opts.manifest))
    scripts = manifests if not opts.no_twins else [s for s in manifests if not s.id.endswith(TWIN)]
    if opts.only:
        scripts = [s for s in scripts if any(s.id == o or s.id.startswith(o) for o in opts.only)]
        if not scripts:
            parser.error(f"--only {opts.only}: no such script id")
    mirrors, work = opts.mirrors.resolve(), opts.work.resolve()
    work.mkdir(parents=True, exist_ok=True)

    opts.out.mkdir(parents=True, exist_ok=True)
    partial = opts.out / "rows.partial.jsonl"  # each row as it ends (kept if the run dies before the end)

    def one(script: Script) -> dict:
        row = run_one(script, mirrors, work, opts.python)
        print(f"{row['id']}: {row['verdict']} ({row['seconds']} s) {row['detail'][:160]}", flush=True)
        with open(partial, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        return row

    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        rows = list(pool.map(one, scripts))

    opts.out.mkdir(parents=True, exist_ok=True)
    previous = opts.out / "results.json"
    if opts.only and previous.is_file():
        # a partial run updates its rows of the last full run; the rest stay as they were
        ran = {r["id"]: r for r in rows}
        order = [s.id for s in manifests]
        old = {r["id"]: r for r in json.loads(previous.read_text(encoding="utf-8"))["scripts"]}
        merged = dict(old, **ran)
        rows = [merged[i] for i in order if i in merged]
    attach_judgements(rows, manifests)
    (opts.out / "results.json").write_text(json.dumps({"summary": summary_line(rows), "python": opts.python,
                                                       "scripts": rows}, indent=1) + "\n", encoding="utf-8")
    (opts.out / "RESULTS.md").write_text(markdown(rows), encoding="utf-8")
    partial.unlink(missing_ok=True)
    print(summary_line(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

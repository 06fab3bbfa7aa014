"""benchmarks/gpu/run.py, the one-command GPU check: its parts here (no torch), and its CPU
dry run end to end on a good case and a planted broken one (e2e)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp2_retrofit.cli.rewrite import rewrite_command

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.py"
FIXTURES = ROOT / "fixtures" / "rewrite"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_check_run", RUN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _cli_options(flags) -> dict:
    """What the rewrite CLI makes of `flags`: its parameters, under RetrofitOptions' names."""
    params = rewrite_command.make_context("rewrite", [*flags, "input.py"]).params
    params["reduce_logs"] = not params.pop("no_reduce_logs")
    params["hsdp"] = params["hsdp"] or 0
    return params


def test_every_case_and_variant_gives_the_cli_its_options(gpu):
    """The flags built from each case.toml (plus each variant) are what the CLI reads back:
    a renamed flag or a case option without one fails here, not on the GPU box."""
    for case in gpu.load_cases(FIXTURES, []):
        for added in [{}, *[v for v in gpu.VARIANTS.values() if v]]:
            options = {**case.options, **added}
            got = _cli_options(gpu.rewrite_flags(options))
            for key, value in options.items():
                want = tuple(value) if isinstance(value, list) else value
                assert got[key] == want, (case.name, key, got[key], want)


def test_flags_of_each_kind(gpu):
    assert gpu.rewrite_flags({"meta_init": True, "cpu_offload": False, "mixed_precision": "bf16", "hsdp": 2,
                              "shard": ["Block", "Head"], "reduce_logs": False}) == [
        "--meta-init", "--mixed-precision", "bf16", "--hsdp", "2", "--shard", "Block", "--shard", "Head",
        "--no-reduce-logs"]
    with pytest.raises(ValueError, match="mp_reduce_dtype"):
        gpu.rewrite_flags({"mp_reduce_dtype": "bfloat16"})


def test_project_of_a_case_that_edits_its_siblings(gpu, tmp_path):
    case = gpu.load_cases(FIXTURES, ["trainer_class_sibling"])[0]
    golden = gpu.project(case, tmp_path / "golden", golden=True)
    assert golden.read_bytes() == (case.folder / "expected.py").read_bytes()
    assert (tmp_path / "golden" / "trainer.py").read_bytes() == (case.folder / "expected" / "trainer.py").read_bytes()
    original = gpu.project(case, tmp_path / "original", golden=False)
    assert original.read_bytes() == (case.folder / "input.py").read_bytes()
    assert (tmp_path / "original" / "trainer.py").read_bytes() == (case.folder / "trainer.py").read_bytes()
    left = {p.relative_to(tmp_path / "original").as_posix() for p in (tmp_path / "original").rglob("*")}
    assert not {"expected.py", "case.toml", "expected"} & left


def test_stub_packages_and_data_files_travel(gpu, tmp_path):
    """A case's stub `torchvision/` must shadow the real one where the script runs."""
    cases = [c for c in gpu.load_cases(FIXTURES, []) if (c.folder / "torchvision").is_dir()]
    assert cases
    gpu.project(cases[0], tmp_path, golden=True)
    assert (tmp_path / "torchvision" / "__init__.py").is_file()


def test_variants_that_need_no_run(gpu, tmp_path):
    meta = gpu.load_cases(FIXTURES, ["meta_init_plain"])[0]
    budget = gpu.Budget(600, 60)
    same = gpu.run_variant(meta, "meta-init", tmp_path, 3, budget)
    assert same.status == "same" and same.flags == ["--meta-init"]
    na = gpu.run_variant(meta, "compile-per-block", tmp_path, 3, budget)
    assert na.status == "n/a" and "no rewrite option" in na.error
    spent = gpu.run_variant(meta, "bf16", tmp_path, 3, gpu.Budget(0, 60))
    assert spent.status == "skipped" and "budget" in spent.error
    hsdp = gpu.load_cases(FIXTURES, ["hsdp_four_ranks"])[0]
    for variant in ("golden", "bf16"):
        one_rank = gpu.run_variant(hsdp, variant, tmp_path, 3, budget)
        assert one_rank.status == "n/a" and "needs a multiple of 2 ranks" in one_rank.error, one_rank
    assert not any(tmp_path.iterdir())  # nothing was rewritten or run


def _row(gpu, variant, status="pass", ms=None, mib=None, kind="cuda", error=""):
    return gpu.Row("c", variant, status=status, error=error, steps=5,
                   step_seconds=None if ms is None else ms / 1000,
                   peak_memory_bytes=None if mib is None else mib * 2**20, memory_kind=kind)


def test_ratios_and_table(gpu):
    rows = [_row(gpu, "original", ms=10, mib=100), _row(gpu, "golden", ms=12, mib=110),
            _row(gpu, "bf16", status="fail", error="RuntimeError: boom | here"),
            _row(gpu, "cpu-offload", ms=30, mib=50, kind="rss"),
            _row(gpu, "meta-init", status="refused", error="FSR628 line 3: no")]
    gpu.add_ratios(rows)
    assert rows[1].time_ratio == pytest.approx(1.2) and rows[1].memory_ratio == pytest.approx(1.1)
    assert rows[2].time_ratio is None  # a failed run has no ratio
    assert rows[3].time_ratio == pytest.approx(3.0) and rows[3].memory_ratio is None  # rss vs cuda: no ratio
    meta = {"date": "d", "dry_run": False, "steps": 5, "jobs": 1, "cases": 1, "wall_s": 1.0, "budget_s": 2.0,
            "machine": {"device": "GPU X", "torch": "2.x", "cuda_version": "13", "nccl": True, "cuda": True}}
    text = gpu.markdown(rows, meta, ["golden", "bf16", "meta-init", "cpu-offload"])
    assert "| c | golden | pass | 5 | 12.0 | 110.0 | 1.20 | 1.10 | - |  |" in text
    assert "| c | bf16 | fail | 5 | - | - | - | - | - | RuntimeError: boom \\| here |" in text
    assert "| golden | 1 | 0 | 0 | 0 | 0 | 0 | 1.20 | 1.10 |" in text
    assert "| meta-init | 0 | 0 | 1 | 0 | 0 | 0 | - | - |" in text


def test_results_file_own_or_a_section(gpu, tmp_path):
    own = tmp_path / "RESULTS-gpu.md"
    gpu.write(own, "## first\n")
    gpu.write(own, "## second\n")
    assert own.read_text() == f"{gpu.TITLE}\n\n## second\n"  # its own file: replaced
    other = tmp_path / "RESULTS.md"
    other.write_text("# Benchmark results\n\nkept\n")
    gpu.write(other, "## gpu\n")
    assert other.read_text() == "# Benchmark results\n\nkept\n\n## gpu\n"  # another's: a section added


PLANTED = "raise RuntimeError('planted: this golden cannot run')\n"


@pytest.mark.e2e
def test_dry_run_reports_every_row_and_a_failure_with_its_error(tmp_path):
    """The CPU dry run on a copy of main_modulelist and a case whose golden is planted broken
    (a BatchNorm model: its bf16 variant is refused)."""
    fixtures = tmp_path / "fixtures"
    shutil.copytree(FIXTURES / "main_modulelist", fixtures / "main_modulelist")
    shutil.copytree(FIXTURES / "batchnorm_per_rank", fixtures / "planted_broken")
    golden = fixtures / "planted_broken" / "expected.py"
    golden.write_text(PLANTED + golden.read_text())
    out = tmp_path / "out.md"
    proc = subprocess.run([sys.executable, str(RUN), "--dry-run", "--fixtures", str(fixtures), "--variants", "golden",
                           "bf16", "compile-per-block", "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 1, "a failing row: exit 1"
    text = out.read_text()
    table = [line.split(" | ") for line in text.splitlines()
             if line.startswith(("| main_modulelist |", "| planted_broken |"))]
    got = [(cells[0].lstrip("| "), cells[1], cells[2]) for cells in table]
    assert got == [("main_modulelist", "original", "pass"), ("main_modulelist", "golden", "pass"),
                   ("main_modulelist", "bf16", "pass"), ("main_modulelist", "compile-per-block", "n/a"),
                   ("planted_broken", "original", "pass"), ("planted_broken", "golden", "fail"),
                   ("planted_broken", "bf16", "refused"), ("planted_broken", "compile-per-block", "n/a")]
    rows = {(r["case"], r["variant"]): r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["planted_broken", "golden"]["error"] == "RuntimeError: planted: this golden cannot run"
    assert "RuntimeError: planted: this golden cannot run" in text
    assert rows["planted_broken", "bf16"]["error"].startswith("FSR603 line ")
    for variant in ("original", "golden", "bf16"):
        row = rows["main_modulelist", variant]
        assert row["steps"] == 3 and len(row["step_samples"]) == 2 and row["step_seconds"] > 0, row
        assert row["memory_kind"] == "rss" and row["peak_memory_bytes"] > 0, row
    assert rows["main_modulelist", "golden"]["backend"] == "gloo"  # CUDA hidden: the generated code's CPU choice
    assert rows["main_modulelist", "bf16"]["time_ratio"] > 0 and rows["main_modulelist", "bf16"]["memory_ratio"] > 0
    assert rows["main_modulelist", "bf16"]["flags"] == ["--mixed-precision", "bf16"]


def test_the_check_runs_the_gpu_path_of_cpu_only_scripts(gpu):
    """The fixtures of issue 44's class 1 (a script that names no device; a literal GPU 0) are golden
    rows of the GPU check: only there do the targets, labels and `.numpy()` meet CUDA outputs."""
    names = {case.name for case in gpu.load_cases(FIXTURES, [])}
    assert {"cpu_only_accuracy_numpy", "cpu_only_accuracy_numpy_engine", "literal_device_zero"} <= names
    golden = (FIXTURES / "cpu_only_accuracy_numpy" / "expected.py").read_text()
    assert "labels = labels.to(device)" in golden and ".cpu().numpy()" in golden
    literal = (FIXTURES / "literal_device_zero" / "expected.py").read_text()
    assert 'torch.device("cuda" if' in literal and "criterion = criterion.cuda()\n" in literal
    assert "probe = probe.to(local_rank)" in literal

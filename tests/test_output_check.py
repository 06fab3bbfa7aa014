"""The rewritten script is checked for the run-time crashes no stage can fix (FSD117):
each finding is an attention item at the user's line, and the crash it announces is
real (the output run under torchrun with the branch taken)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import pytest

from fsdp2_retrofit.rewrite.pipeline import rewrite_source
from fsdp2_retrofit.verify import VerifyError, launch_distributed
from rewrite_cases import FIXTURES, rewrite_case

CASE = FIXTURES / "param_numpy_logging"


def _numpy_line(path: Path) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if ".numpy()" in line)


def test_the_report_names_the_line_of_the_numpy_call():
    result = rewrite_case(CASE)
    flagged = [a for a in result.attention if a.what.startswith("FSD117")]
    assert [a.line for a in flagged] == [_numpy_line(CASE / "input.py")]
    assert flagged[0].differs and flagged[0].code == "check"
    assert ".numpy()" in (CASE / "expected.py").read_text()  # left as written: only a person can place the gather


@pytest.mark.parametrize("read", [
    "value.shape",  # plain numbers
    "value.detach().norm().item()",
    "value.full_tensor().cpu().numpy()",  # already gathered (a collective on every rank)
])
def test_reads_that_survive_sharding_are_not_flagged(read):
    script = (CASE / "input.py").read_text().replace("value.detach().cpu().numpy()", read)
    result = rewrite_source(script.encode(), "train.py")
    assert not result.refusals
    assert not [a for a in result.attention if a.code == "check"], result.attention


def test_output_without_numpy_or_tolist_is_not_analysed(monkeypatch):
    import libcst as cst

    from fsdp2_retrofit.check import lint
    from fsdp2_retrofit.rewrite.output_check import crashes_in_output
    from fsdp2_retrofit.syntax.names import Origins

    built = []
    original = lint.LintContext.__init__
    monkeypatch.setattr(lint.LintContext, "__init__", lambda self, *a, **k: built.append(1) or original(self, *a, **k))
    for text, analysed in [
        ("from torch.distributed.fsdp import fully_shard\nfully_shard(model)\nw = model.head.weight.tolist()\n", True),
        ("from torch.distributed.fsdp import fully_shard\nfully_shard(model)\nopt = SGD(model.parameters())\n", False),
    ]:
        built.clear()
        module = cst.parse_module(text)
        found = crashes_in_output(module, text.encode(), "train.py", Origins(module, text))
        assert bool(built) is analysed and bool(found) is analysed, (text, found)


def test_a_rewrite_without_numpy_or_tolist_does_not_load_check():
    """The gate comes before the imports: a fresh interpreter rewriting a script that
    cannot hit FSD117 never loads check's modules (start-up cost of every rewrite)."""
    code = (
        "import sys\nfrom fsdp2_retrofit.rewrite.pipeline import rewrite_source\n"
        f"rewrite_source(open({str(FIXTURES / 'main_modulelist' / 'input.py')!r}, 'rb').read(), 'train.py')\n"
        "print(sorted(m for m in sys.modules if m.startswith('fsdp2_retrofit.check')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.e2e
def test_the_flagged_line_does_crash_under_fsdp2(tmp_path: Path):
    """What the attention item says happens: with the branch taken, the output dies at
    the `.numpy()` (the parity run, where it is not taken, is test_execution's)."""
    with pytest.raises(VerifyError) as failure:
        launch_distributed(CASE / "expected.py", ["--batch-size", "32", "--log-every", "2"], tmp_path / "dist")
    assert "numpy" in failure.value.detail.lower() or "DTensor" in failure.value.detail, failure.value.detail

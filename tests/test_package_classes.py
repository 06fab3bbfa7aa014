"""A model class of the project's package built from blocks of another module of the package is read
whole, however the package imports them (project_package_batchnorm, with golden and execution tests,
uses a star import): its BatchNorm is found and reported."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fsdp2_retrofit.pipeline import rewrite_source

CASE = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite" / "project_package_batchnorm"


@pytest.mark.parametrize("imports, block", [
    ("from .layers import NormedLinear\nimport torch.nn as nn\n", "NormedLinear"),
    ("from . import layers\nimport torch.nn as nn\n", "layers.NormedLinear"),
    ("import torch.nn as nn\nfrom nets.layers import NormedLinear\n", "NormedLinear"),
])
def test_the_blocks_of_another_module_of_the_package_are_read(tmp_path, imports: str, block: str):
    project = tmp_path / "project"
    shutil.copytree(CASE, project, ignore=shutil.ignore_patterns("expected*", "case.toml"))
    classifier = project / "nets" / "classifier.py"
    text = classifier.read_text().replace("from .layers import *\n", imports)
    classifier.write_text(text.replace("NormedLinear(d_in, hidden)", f"{block}(d_in, hidden)"))
    entry = project / "input.py"
    result = rewrite_source(entry.read_bytes(), str(entry))
    assert not result.refusals, result.refusals
    flagged = [a for a in result.attention if a.differs and "BatchNorm" in a.what]
    assert [(a.line, "layers.py:8" in a.what) for a in flagged] == [(23, True)], result.attention
    assert "nn.SyncBatchNorm.convert_sync_batchnorm(model)" in result.code.decode()

"""Constructs that would train silently wrong after the rewrite (issue 14): each is
either converted (a fixture with an execution test covers it) or refused with its
code, on the line that causes it, the file untouched."""
from __future__ import annotations

import json
import textwrap

from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.rewrite.pipeline import rewrite_source

HEAD = '''\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


'''


def _script(body: str) -> str:
    return HEAD + textwrap.dedent(body)


def _refusals(source: str):
    result = rewrite_source(source.encode(), "train.py")
    return [(r.code, r.line) for r in result.refusals], result


def _line_of(source: str, fragment: str) -> int:
    return next(n for n, line in enumerate(source.splitlines(), 1) if fragment in line)


LOOP = '''\
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), batch_size=4)
    for x, y in loader:
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(model.state_dict(), "out.pt")
'''


# --- item 2: structural changes after the build --------------------------------




def test_a_model_rebound_to_a_wrapper_is_refused(tmp_path, monkeypatch):
    source = _script('''\
    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.inner(x) * self.scale


    def main():
        model = Net()
        model = Scaled(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ''' + LOOP)
    found, _ = _refusals(source)
    assert found[:1] == [("FSR620", _line_of(source, "model = Scaled(model)"))]
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    path.write_text(source)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path)])
    assert result.exit_code == 2
    line = _line_of(source, "model = Scaled(model)")
    assert result.stderr.splitlines()[0].startswith(f"{path}:{line}: FSR620 ")
    assert path.read_text() == source


def test_torch_compile_after_the_build_is_not_a_wrapper():
    source = _script('''\
    def main():
        model = Net()
        model = torch.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ''' + LOOP)
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert code.index("fully_shard(model") < code.index("model = torch.compile(model)")


def test_a_wrapper_with_its_own_name_is_converted():
    source = _script('''\
    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2


    def main():
        model = Net()
        wrapped = Scaled(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ''' + LOOP)
    found, _ = _refusals(source)
    assert found == []

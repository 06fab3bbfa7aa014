"""A model class of a sibling module whose method other than forward reads the
parameters (an RNN's `init_hidden` taking dtype and device from `next(self.parameters())`)
gets the treatment the same class defined in the script gets, however the script imports
it: `from model import RNN`, `import model` / `import model as m` (word_language_model's
`model = model.RNNModel(...)`), `import pkg.model`, `from pkg import model`, or through a
package that re-exports it (`from .model import RNN` in `pkg/__init__.py`). The class is
followed through the import (its qualified name, ClassRegistry), by rewrite (the method is
registered with register_fsdp_forward_method; FSR623 where the parameter is a block's) and
by check (FSD122 where it is not registered)."""
from __future__ import annotations

from textwrap import dedent

import pytest

from fsdp2_retrofit.analysis.model_classes import build_registry
from fsdp2_retrofit.check.lint import lint_source
from fsdp2_retrofit.check.rules import all_rules
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import Resolver

import libcst as cst

CLASS = dedent("""\
    class RNN(nn.Module):
        def __init__(self, vocab=10, dim=4):
            super().__init__()
            self.dim = dim
            self.embed = nn.Embedding(vocab, dim)
            self.cell = nn.GRUCell(dim, dim)
            self.head = nn.Linear(dim, vocab)

        def init_hidden(self, batch):
            return next(self.parameters()).new_zeros(batch, self.dim)

        def forward(self, tokens, hidden):
            return self.head(self.cell(self.embed(tokens), hidden))
    """)

# init_hidden reads a parameter of a block that becomes its own unit: refused (FSR623)
BLOCK_CLASS = dedent("""\
    class RNN(nn.Module):
        def __init__(self, vocab=10, dim=4):
            super().__init__()
            self.cells = nn.ModuleList([nn.GRUCell(dim, dim) for _ in range(2)])
            self.head = nn.Linear(dim, vocab)

        def init_hidden(self, batch):
            return [next(self.parameters()).new_zeros(batch, 4) for _ in self.cells]

        def forward(self, x, hidden):
            for i, cell in enumerate(self.cells):
                hidden[i] = x = cell(x, hidden[i])
            return self.head(x)
    """)

SCRIPT = dedent("""\
    import torch
    import torch.nn as nn
    {imports}


    def main():
        net = {ctor}(){to}
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            tokens = torch.randint(0, 10, (2,))
            hidden = net.init_hidden(2)
            loss = net(tokens, hidden).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        torch.save(net.state_dict(), "net.pt")


    if __name__ == "__main__":
        main()
    """)

# (the import line, the file that defines RNN, what the script calls to build it, the
# package's __init__.py when it re-exports the class)
IMPORTS = {
    "from": ("from model import RNN", "model.py", "RNN", None),
    "import": ("import model", "model.py", "model.RNN", None),
    "import-as": ("import model as m", "model.py", "m.RNN", None),
    "import-dotted": ("import pkg.model", "pkg/model.py", "pkg.model.RNN", None),
    "from-package-module": ("from pkg import model as rnn_model", "pkg/model.py", "rnn_model.RNN", None),
    "package-re-export": ("from pkg import RNN", "pkg/model.py", "RNN", "from .model import RNN\n"),
    "package-re-export-absolute": ("from pkg import Net", "pkg/model.py", "Net", "from pkg.model import RNN as Net\n"),
    "package-re-export-import": ("import pkg", "pkg/model.py", "pkg.RNN", "from . import model\nfrom .model import RNN\n"),
}


def _in_script(class_source: str = CLASS, to: str = "") -> str:
    return SCRIPT.format(imports="\n\n" + class_source, ctor="RNN", to=to)


def _sibling(tmp_path, form: str, class_source: str = CLASS, to: str = "") -> tuple:
    """(the script's path, its text) with RNN in a sibling file imported the `form` way."""
    imports, file, ctor, init = IMPORTS[form]
    sibling = tmp_path / file
    sibling.parent.mkdir(parents=True, exist_ok=True)
    sibling.write_text("import torch.nn as nn\n\n\n" + class_source)
    if init is not None:
        (tmp_path / "pkg" / "__init__.py").write_text(init)
    script = tmp_path / "train.py"
    text = SCRIPT.format(imports=imports, ctor=ctor, to=to)
    script.write_text(text)
    return script, text


def _treatment(result) -> list:
    """What the rewrite did, without the lines (the in-script class adds lines)."""
    return [(c.code, c.what) for c in result.changes], [(r.code, r.what) for r in result.refusals]


@pytest.mark.parametrize("form", sorted(IMPORTS))
def test_the_class_is_read_under_its_qualified_name(tmp_path, form):
    script, text = _sibling(tmp_path, form)
    module = cst.parse_module(text)
    resolver = Resolver(module)
    registry = build_registry(module, resolver, str(script))
    call = next(c for c in resolver.nodes(cst.Call) if cst.Module([]).code_for_node(c.func) == IMPORTS[form][2])
    (qname,) = resolver.qnames(call)
    info = registry.get(qname)
    assert info is not None and info.is_module and "init_hidden" in info.methods, qname


@pytest.mark.parametrize("form", sorted(IMPORTS))
def test_a_sibling_class_method_is_registered_like_an_in_script_one(tmp_path, form):
    script, text = _sibling(tmp_path, form)
    result = rewrite_source(text.encode(), str(script))
    reference = rewrite_source(_in_script().encode(), str(tmp_path / "alone.py"))
    assert 'register_fsdp_forward_method(net, "init_hidden")' in result.code.decode()
    assert _treatment(result) == _treatment(reference)


@pytest.mark.parametrize("form", sorted(IMPORTS))
def test_a_sibling_class_method_reading_a_block_parameter_is_refused_like_an_in_script_one(tmp_path, form):
    script, text = _sibling(tmp_path, form, BLOCK_CLASS)
    result = rewrite_source(text.encode(), str(script))
    reference = rewrite_source(_in_script(BLOCK_CLASS).encode(), str(tmp_path / "alone.py"))
    assert [r.code for r in reference.refusals] == ["FSR623"]
    assert _treatment(result) == _treatment(reference)
    # a class of another file: the refusal names the line that builds the model
    assert result.refusals[0].line == text.splitlines().index(f"    net = {IMPORTS[form][2]}()") + 1


def _unregistered(code: str) -> str:
    return "".join(line for line in code.splitlines(keepends=True) if "register_fsdp_forward_method(" not in line)


def _fsd122(path, text: str) -> list:
    path.write_text(text)
    return [(f.code, f.line) for f in lint_source(text.encode(), str(path), all_rules()).findings
            if f.code == "FSD122"]


@pytest.mark.parametrize("form", sorted(IMPORTS))
def test_check_flags_the_unregistered_method_of_a_sibling_class_like_an_in_script_one(tmp_path, form):
    script, text = _sibling(tmp_path, form, to=".to('cpu')")
    sharded = _unregistered(rewrite_source(text.encode(), str(script)).code.decode())
    alone = _unregistered(rewrite_source(_in_script(to=".to('cpu')").encode(), str(tmp_path / "alone.py")).code.decode())
    found = _fsd122(tmp_path / "sharded.py", sharded)
    assert found == [("FSD122", sharded.splitlines().index("        hidden = net.init_hidden(2)") + 1)]
    assert len(_fsd122(tmp_path / "alone_sharded.py", alone)) == 1


@pytest.mark.parametrize("form", sorted(IMPORTS))
def test_check_passes_the_registered_method_of_a_sibling_class(tmp_path, form):
    script, text = _sibling(tmp_path, form)
    assert _fsd122(tmp_path / "sharded.py", rewrite_source(text.encode(), str(script)).code.decode()) == []


def test_a_class_of_the_same_bare_name_in_another_module_is_not_taken_for_it(tmp_path):
    """The script builds `RNN` of a library (not read); a sibling module it also imports
    defines another `RNN`. Neither rewrite nor check takes one for the other by its name."""
    (tmp_path / "model.py").write_text("import torch.nn as nn\n\n\n" + CLASS)
    script = tmp_path / "train.py"
    text = SCRIPT.format(imports="import model\nfrom recurrent_lib import RNN", ctor="RNN", to="")
    result = rewrite_source(text.encode(), str(script))
    assert "register_fsdp_forward_method" not in result.code.decode()
    assert "fully_shard(net" in result.code.decode()
    assert _fsd122(tmp_path / "sharded.py", result.code.decode()) == []

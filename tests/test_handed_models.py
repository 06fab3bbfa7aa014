"""handed_models: a model built inside the call that hands it to the project's trainer is bound
to a name first, so it is sharded before the trainer builds its optimizer (the fixtures
trainer_inline_model and trainer_inline_model_sibling run it at parity); what may not move
stays, with the shard stage's refusal."""
from __future__ import annotations

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = '''\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.fc = nn.Linear(width, 4)

    def forward(self, x):
        return self.fc(x)


class Pair:
    def __init__(self, gen, disc):
        self.gen, self.disc = gen, disc
        self.opt_g = torch.optim.SGD(self.gen.parameters(), lr=0.1)
        self.opt_d = torch.optim.SGD(self.disc.parameters(), lr=0.1)

    def fit(self, x):
        for _ in range(3):
            loss = self.disc(self.gen(x)).sum()
            self.opt_g.zero_grad()
            self.opt_d.zero_grad()
            loss.backward()
            self.opt_g.step()
            self.opt_d.step()


class Simple:
    def __init__(self, tag, model):
        self.model = model
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def fit(self, x):
        for _ in range(3):
            loss = self.model(x).sum()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()


def label():
    return "run"


def main():
    x = torch.randn(8, 4)
{body}


if __name__ == "__main__":
    main()
'''


def _rewrite(body: str):
    return rewrite_source(HEAD.format(body=body).encode(), "train.py", RetrofitOptions())


@pytest.mark.parametrize("body", [
    "    Simple('a', Net(4)).fit(x)",  # a literal before it, the call's receiver of a method call
    "    trainer = Simple(tag='b', model=Net())\n    trainer.fit(x)",  # by keyword
])
def test_a_model_built_in_a_trainers_arguments_is_named_and_sharded_before_the_call(body):
    result = _rewrite(body)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "    model = Net(" in code
    main = code[code.index("def main():"):]
    assert main.index("model = Net(") < main.index("fully_shard(model") < main.index("Simple(")
    assert [c.code for c in result.changes].count("handed_models") == 1


@pytest.mark.parametrize("body, why", [
    ("    Simple(label(), Net()).fit(x)", "a call before it: evaluated first"),
    ("    Simple('c', Net() if x.sum() > 0 else Net(8)).fit(x)", "a conditional build"),
    ("    runs = [Simple('d', Net()) for _ in range(2)]\n    runs[0].fit(x)", "built once per element"),
])
def test_a_build_that_may_not_move_stays_and_the_file_is_refused(body, why):
    result = _rewrite(body)
    assert result.refusals, why
    assert "handed_models" not in [c.code for c in result.changes]
    assert result.code == HEAD.format(body=body).encode()


def test_a_script_that_binds_its_model_is_left_to_the_other_stages():
    body = "    net = Net()\n    Simple('e', net).fit(x)\n    Simple('f', Net(4))"
    result = _rewrite(body)
    assert "handed_models" not in [c.code for c in result.changes]


def test_two_models_handed_to_one_trainer_are_both_named_in_their_order():
    body = ("    pair = Pair(Net(4), Net(4).to('cpu'))\n    pair.fit(x)")
    result = _rewrite(body)
    code = result.code.decode()
    main = code[code.index("def main():"):]
    assert main.index("    model = Net(4)\n") < main.index("    model_2 = Net(4).to('cpu')\n") < main.index(
        "pair = Pair(model, model_2)"), main
    assert [c.code for c in result.changes].count("handed_models") == 2


def test_a_build_that_cannot_move_is_refused_naming_it_at_its_line():
    body = "    Simple(label(), Net()).fit(x)"
    result = _rewrite(body)
    assert [r.code for r in result.refusals] == ["FSR610"], result.refusals
    refusal = result.refusals[0]
    assert refusal.line == HEAD.format(body=body).splitlines().index(body) + 1
    assert "the model `Net()` is built inside the arguments of `Simple(...)`" in refusal.what
    assert "bind it first: `model = Net()`" in refusal.hint


def test_a_model_a_factory_returns_handed_inline_converts_as_if_named():
    """`Trainer(build_net(4)).fit(x)`: the factory builds and returns the model (sharded inside it, as
    for `model = build_net(4)`); it was refused FSR404 (the helper's return received by no assignment)."""
    factory = "def build(width):\n    net = Net(width)\n    return net\n\n\ndef main():"
    inline = HEAD.replace("def main():", factory, 1).format(body="    Simple('g', build(4)).fit(x)")
    named = HEAD.replace("def main():", factory, 1).format(body="    model = build(4)\n    Simple('g', model).fit(x)")
    result = rewrite_source(inline.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    expected = rewrite_source(named.encode(), "train.py", RetrofitOptions())
    assert result.code == expected.code
    assert [c.code for c in result.changes].count("handed_models") == 1


def test_a_sibling_modules_factory_handed_inline_is_named(tmp_path):
    (tmp_path / "nets.py").write_text(
        "import torch.nn as nn\n\n\nclass Wide(nn.Module):\n    def __init__(self, w):\n        super().__init__()\n"
        "        self.fc = nn.Linear(w, 4)\n\n    def forward(self, x):\n        return self.fc(x)\n\n\n"
        "def make_net(w):\n    return Wide(w)\n")
    body = "    Simple('h', model=make_net(4)).fit(x)"
    source = ("from nets import make_net\n" + HEAD).format(body=body)
    (tmp_path / "train.py").write_text(source)
    result = rewrite_source(source.encode(), str(tmp_path / "train.py"), RetrofitOptions())
    assert not result.refusals, result.refusals
    code = result.code.decode()
    main = code[code.index("def main():"):]
    assert main.index("model = make_net(4)") < main.index("fully_shard(model, mesh=mesh)") < main.index(
        "Simple('h', model=model)")

"""A loader helper that is a method of the script's class (or a function its methods call) builds the
training loader and a validation loader: only the call whose loader a training loop reads passes
`distributed=True`, followed by value through attributes, tuple targets and names, and the epoch is set
before the pass over the training attribute. (The execution tests of loader_method_shared and
project_trainer_loader_method show the printed validation figure equals the single run's.)"""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.pipeline import rewrite_source

SOLVER = dedent('''\
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset


    class Solver:
        def __init__(self, bs):
            self.model = nn.Linear(4, 2)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
    BUILD
        def make_loader(self, n, bs, shuffle):
            x = torch.randn(n, 4)
            ds = TensorDataset(x, (x[:, 0] > 0).long())
            return DataLoader(ds, batch_size=bs, shuffle=shuffle)

        def score(self):
            return sum((self.model(x).argmax(1) == y).sum().item() for x, y in self.val_loader)

        def train(self, epochs):
            for epoch in range(epochs):
                for x, y in self.train_loader:
                    self.opt.zero_grad()
                    nn.functional.cross_entropy(self.model(x), y).backward()
                    self.opt.step()
                print(f"epoch {epoch}: hits {self.score()}")


    Solver(8).train(2)
    ''')



def _solver(build: str) -> str:
    body = "".join("        " + line + "\n" for line in dedent(build).strip().splitlines())
    return SOLVER.replace("BUILD\n", body + "\n")


def _out(build: str):
    result = rewrite_source(_solver(build).encode(), "train.py")
    assert not result.refusals, result.refusals
    return result, result.code.decode()


def _split_calls(text: str) -> list:
    return [line.strip() for line in text.splitlines() if "make_loader(" in line and "def " not in line]


def test_each_attribute_its_own_call():
    result, text = _out('''
        self.train_loader = self.make_loader(64, bs, True)
        self.val_loader = self.make_loader(20, 10, False)
    ''')
    assert _split_calls(text) == ["self.train_loader = self.make_loader(64, bs, True, distributed=True)",
                                  "self.val_loader = self.make_loader(20, 10, False)"]
    assert "def make_loader(self, n, bs, shuffle, distributed=False):" in text
    assert "            self.train_loader.sampler.set_epoch(epoch)\n            for x, y in self.train_loader:" in text
    # the score runs the sharded model: computed on every rank, only the print is rank 0's
    assert "logged_value = self.score()" in text
    assert not [a for a in result.attention if a.differs], result.attention


def test_a_tuple_of_attributes_and_a_name_kept_as_an_attribute_give_the_same():
    for build in ('''
        self.train_loader, self.val_loader = self.make_loader(64, bs, True), self.make_loader(20, 10, False)
    ''', '''
        loader = self.make_loader(64, bs, True)
        self.val_loader = self.make_loader(20, 10, False)
        self.train_loader = loader
    '''):
        result, text = _out(build)
        calls = _split_calls(text)
        assert sum("distributed=True" in c for c in calls) == 1, calls
        assert [c for c in calls if "distributed=True" in c][0].count("64") == 1, calls
        assert "self.train_loader.sampler.set_epoch(epoch)" in text
        assert not [a for a in result.attention if a.differs], result.attention


def test_a_call_through_the_class_is_a_call_of_the_method():
    _, text = _out('''
        self.train_loader = self.make_loader(64, bs, True)
        self.val_loader = Solver.make_loader(self, 20, 10, False)
    ''')
    assert _split_calls(text) == ["self.train_loader = self.make_loader(64, bs, True, distributed=True)",
                                  "self.val_loader = Solver.make_loader(self, 20, 10, False)"]


def test_a_use_the_analysis_cannot_follow_splits_every_loader_and_says_so_there():
    """`getattr(self, "make_loader")` is no call the flow binds to the method: the training call cannot be
    told from the others, so the DataLoader is split as a whole, and the report says what that does to
    the validation loader, at the line of that use."""
    result, text = _out('''
        self.train_loader = self.make_loader(64, bs, True)
        build = self.make_loader
        self.val_loader = build(20, 10, False)
    ''')
    assert "distributed=True" not in text and "sampler = DistributedSampler(ds, shuffle=shuffle)" in text
    said = [a for a in result.attention if "not follow" in a.what]
    assert [(a.line, a.differs) for a in said] == [(11, True)], result.attention


def test_a_dict_of_loaders_is_refused_at_the_loader_not_converted():
    result = rewrite_source(_solver('''
        self.loaders = {"train": self.make_loader(64, bs, True), "val": self.make_loader(20, 10, False)}
        self.train_loader, self.val_loader = self.loaders["train"], self.loaders["val"]
    ''').encode(), "train.py")
    assert result.refusals and result.refusals[0].code == "FSR902", result.refusals
    assert result.code == result.original

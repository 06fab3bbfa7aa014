"""A DataLoader built by a function of a sibling module (`train_loader = make_loader(...)`,
`from loaders import make_loader`): the rewrite edits one file, so it says which function
and line build the loader that gets no DistributedSampler (attention, `differs`), instead of
"no DataLoader"."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.rewrite.pipeline import rewrite_source

LOADERS = dedent("""\
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    def make_loader(n, batch_size, shuffle):
        data = TensorDataset(torch.randn(n, 8), torch.randint(0, 2, (n,)))
        return DataLoader(data, batch_size=batch_size, shuffle=shuffle)
    """)

SCRIPT = dedent("""\
    import torch
    import torch.nn as nn
    from loaders import make_loader


    def train(model, optimizer, loader):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


    def main():
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_loader = make_loader(64, 8, True)
        train(model, optimizer, train_loader)


    main()
    """)


def test_a_loader_built_in_a_sibling_module_is_named(tmp_path):
    (tmp_path / "loaders.py").write_text(LOADERS)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = rewrite_source(SCRIPT.encode(), str(script))
    assert not out.refusals, out.refusals
    items = [a for a in out.attention if a.differs]
    assert [a.line for a in items] == [SCRIPT.splitlines().index("    train_loader = make_loader(64, 8, True)") + 1]
    assert "make_loader() of loaders.py (its line 7)" in items[0].what
    assert not any("no DataLoader" in a.what for a in out.attention)


def test_without_the_sibling_file_it_is_no_dataloader(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = rewrite_source(SCRIPT.encode(), str(script))
    assert any("no DataLoader" in a.what and a.differs for a in out.attention), out.attention

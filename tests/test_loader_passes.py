"""set_epoch for passes a generator repeats: `def cycle(dl): while True: for batch in dl: yield batch`.

The data stage counts the passes inside that function (fixtures cycle_generator and
iter_next_accumulation run it on 2 ranks across several passes). It does so only when every
call of the function hands it the same shuffled, sharded loader: another loader there (an
evaluation loader without a DistributedSampler) has no `sampler.set_epoch`. Where no pass can
be counted, the report says the training differs from the second pass on."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent("""\
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset


    def cycle(loader):
        while True:
            for batch in loader:
                yield batch


    def main():
        data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
        train_loader = DataLoader(data, batch_size=8, shuffle=True)
        val_loader = DataLoader(data, batch_size=8)
        batches = cycle(train_loader)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(20):
            x, y = next(batches)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        EVAL


    if __name__ == "__main__":
        main()
    """)


def _rewrite(text: str):
    result = rewrite_source(text.encode(), "train.py")
    assert not result.refusals, result.refusals
    return result, result.code.decode()


def _passes_item(result):
    return [a for a in result.attention if "read through iter()/next() or a helper" in a.what]


def test_the_generator_counts_its_passes_and_sets_each_ones_epoch():
    result, code = _rewrite(SCRIPT.replace("EVAL", "pass"))
    assert ("def cycle(loader):\n    epoch = 0  # passes over loader\n    while True:\n"
            "        loader.sampler.set_epoch(epoch)\n        epoch += 1\n        for batch in loader:\n") in code
    assert any("before each pass over `loader`" in c.what for c in result.changes)
    assert not _passes_item(result)


def test_a_generator_also_handed_another_loader_is_left_alone_and_the_report_says_training_differs():
    """`cycle(val_loader)` too: the evaluation loader keeps its plain sampler, which has no set_epoch."""
    result, code = _rewrite(SCRIPT.replace("EVAL", "x, y = next(cycle(val_loader))"))
    assert "set_epoch" not in code
    [item] = _passes_item(result)
    assert item.differs and "train_loader" in item.what and "every pass after the first" in item.why


def test_an_unshuffled_loader_needs_no_epoch():
    result, code = _rewrite(SCRIPT.replace("shuffle=True", "shuffle=False").replace("EVAL", "pass"))
    assert "set_epoch" not in code and not _passes_item(result)


def test_a_generator_of_another_scope_is_not_followed():
    """The calls must be in the loader's own scope: a `cycle(train_loader)` elsewhere names
    another binding."""
    text = SCRIPT.replace("EVAL", "pass").replace("        batches = cycle(train_loader)\n", "") \
        .replace("            x, y = next(batches)\n", "            x, y = next(iter(train_loader))\n")
    text += "\n\ndef elsewhere(train_loader):\n    return cycle(train_loader)\n"
    result, code = _rewrite(text)
    assert "set_epoch" not in code

"""--keep-global-batch and a batch size that reaches the DataLoader through a `**` dict: the
dict's value is followed (assignments, aliases, a helper's return, a parameter) to where its
"batch_size" is set, and divided there; where it cannot be followed the report says the global
batch is world_size times larger (`differs`), at the DataLoader's line."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = '''
import torch
from torch import nn
from torch.utils.data import DataLoader


def main(args, data):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
'''

LOOP = '''
    for epoch in range(2):
        for x in loader:
            model(x).sum().backward()
            opt.step()
'''

ASSERT = 'assert args.batch_size % world_size == 0, "the batch size must divide by the number of ranks"\n'


def _rewrite(body: str, keep: bool = True, head: str = HEAD):
    source = dedent(head) + body + LOOP
    return source, rewrite_source(source.encode(), "train.py", RetrofitOptions(keep_global_batch=keep))


def _line_of(source: str, fragment: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if fragment in line)


def _differs(result):
    return [(a.line, a.what) for a in result.attention if a.differs and "--keep-global-batch" in a.what]


def test_the_entry_of_a_dict_literal_is_divided_with_its_assert():
    _, result = _rewrite('''
    train_kwargs = {"batch_size": args.batch_size}
    train_kwargs.update({"num_workers": 0, "shuffle": True})
    loader = DataLoader(data, **train_kwargs)
''')
    text = result.code.decode()
    assert f"    {ASSERT}    train_kwargs = {{\"batch_size\": args.batch_size // world_size}}\n" in text
    assert "loader = DataLoader(data, sampler=sampler, **train_kwargs)" in text
    assert not _differs(result)
    assert any("is divided by the world size here" in c.what for c in result.changes)


def test_without_the_option_the_dict_keeps_its_batch_size():
    _, result = _rewrite('''
    train_kwargs = {"batch_size": args.batch_size, "shuffle": True}
    loader = DataLoader(data, **train_kwargs)
''', keep=False)
    assert "// world_size" not in result.code.decode()


def test_a_dict_call_a_store_and_a_renamed_alias_are_followed():
    _, result = _rewrite('''
    options = dict(batch_size=args.batch_size, shuffle=True)
    chosen = options
    loader = DataLoader(data, **chosen)
''')
    assert "options = dict(batch_size=args.batch_size // world_size, shuffle=True)\n" in result.code.decode()
    _, result = _rewrite('''
    kw = {"shuffle": True}
    kw["batch_size"] = args.batch_size
    loader = DataLoader(data, **kw)
''')
    assert f"    {ASSERT}    kw[\"batch_size\"] = args.batch_size // world_size\n" in result.code.decode()
    _, result = _rewrite('''
    base: dict = {"batch_size": args.batch_size}
    loader = DataLoader(data, **{**base, "drop_last": True})
''')
    assert 'base: dict = {"batch_size": args.batch_size // world_size}\n' in result.code.decode()


def test_a_dict_returned_by_a_helper_is_divided_in_the_helper():
    helper = '''

def loader_options(size):
    return {"batch_size": size, "drop_last": True}
'''
    _, result = _rewrite('''
    loader = DataLoader(data, **loader_options(args.batch_size))
''', head=HEAD.replace("\n\ndef main", helper + "\n\ndef main"))
    text = result.code.decode()
    assert ('    assert size % dist.get_world_size() == 0, "the batch size must divide by the number of ranks"\n'
            '    return {"batch_size": size // dist.get_world_size(), "drop_last": True}\n') in text


def test_a_dict_passed_in_is_divided_where_the_caller_builds_it():
    source = '''
import torch
from torch import nn
from torch.utils.data import DataLoader


def fit(model, opt, data, loader_kwargs):
    loader = DataLoader(data, **loader_kwargs)
    for x in loader:
        model(x).sum().backward()
        opt.step()


def main(args, data):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = {"batch_size": args.batch_size, "shuffle": True}
    fit(model, opt, data, settings)
'''
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions(keep_global_batch=True))
    text = result.code.decode()
    assert f"    {ASSERT}    settings = {{\"batch_size\": args.batch_size // world_size, \"shuffle\": True}}\n" in text


def test_a_dict_the_rewrite_cannot_follow_is_reported_as_a_difference_at_the_loader():
    source, result = _rewrite('''
    loader = DataLoader(data, **vars(args.loader))
''')
    assert "// world_size" not in result.code.decode()
    [(line, what)] = _differs(result)
    assert line == _line_of(source, "loader = DataLoader(")
    assert "`vars(args.loader)` is not a dict the rewrite can follow" in what
    assert "the global batch is world_size x larger" in what


def test_an_update_with_unreadable_keys_is_reported_at_the_loader_naming_its_line():
    source, result = _rewrite('''
    kw = {"batch_size": args.batch_size}
    kw.update(load_settings())
    loader = DataLoader(data, **kw)
''')
    assert "// world_size" not in result.code.decode()  # nothing divided: the update may set it again
    [(line, what)] = _differs(result)
    assert line == _line_of(source, "loader = DataLoader(")
    assert f"(line {_line_of(source, 'kw.update(')}: `load_settings()` is not a dict" in what


def test_a_batch_size_changed_in_place_or_a_name_bound_twice_is_not_divided():
    for body, lost in [
        ('''
    kw = {"batch_size": args.batch_size}
    kw["batch_size"] *= 2
''', "`kw[\"batch_size\"] *= 2` changes the batch size"),
        ('''
    kw = {"batch_size": args.batch_size}
    if args.big:
        kw = {"batch_size": 2 * args.batch_size}
''', "`kw` is bound 2 times"),
        ('''
    kw = {"batch_size": args.batch_size}
    kw["batch_size"] = kw["batch_size"] * 2
''', "is computed from the dict `kw` itself"),
    ]:
        _, result = _rewrite(body + "    loader = DataLoader(data, shuffle=True, **kw)\n")
        assert "// world_size" not in result.code.decode(), body
        [(_, what)] = _differs(result)
        assert lost in what, what


def test_a_dict_without_a_batch_size_is_a_difference_too():
    _, result = _rewrite('''
    kw = {"shuffle": True}
    loader = DataLoader(data, **kw)
''')
    [(_, what)] = _differs(result)
    assert "is set nowhere in `**kw`" in what


def test_a_dict_set_before_the_process_group_starts_is_not_divided():
    source = '''
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader


def main(data):
    kw = {"batch_size": 8, "shuffle": True}
    args = argparse.ArgumentParser().parse_args()
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, **kw)
    for x in loader:
        model(x).sum().backward()
        opt.step()
'''
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions(keep_global_batch=True))
    text = result.code.decode()
    assert text.index("kw = {") < text.index("dist.init_process_group(")  # the preamble follows parse_args
    assert "// world_size" not in text
    [(line, what)] = _differs(result)
    assert line == _line_of(source, "loader = DataLoader(")
    assert f"(line {_line_of(source, 'kw = {')}: it is set before the process group starts)" in what


def test_a_parameter_rebound_in_its_function_is_not_divided():
    source = '''
import torch
from torch import nn
from torch.utils.data import DataLoader


def fit(model, opt, data, kw=None):
    if kw is None:
        kw: dict = {"batch_size": 8}
    loader = DataLoader(data, shuffle=True, **kw)
    for x in loader:
        model(x).sum().backward()
        opt.step()


def main(data):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fit(model, opt, data, {"batch_size": 32})
'''
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions(keep_global_batch=True))
    text = result.code.decode()
    assert "// dist.get_world_size()" not in text and "// world_size" not in text  # neither dict divided
    [(line, what)] = _differs(result)
    assert f"(line {_line_of(source, 'kw: dict = ')}: `kw` is a parameter of fit() and is also bound here" in what


def test_a_store_through_a_later_alias_or_in_a_function_it_is_handed_to_is_divided_too():
    helper = '''

def add_defaults(options):
    options.setdefault("num_workers", 0)
    options["batch_size"] = 64
'''
    _, result = _rewrite('''
    kw = {"batch_size": args.batch_size}
    same = kw
    same["batch_size"] = args.other
    add_defaults(kw)
    loader = DataLoader(data, **kw)
''', head=HEAD.replace("\n\ndef main", helper + "\n\ndef main"))
    text = result.code.decode()
    assert 'kw = {"batch_size": args.batch_size // world_size}\n' in text
    assert 'same["batch_size"] = args.other // world_size\n' in text
    assert 'options["batch_size"] = 64 // dist.get_world_size()\n' in text


def test_a_dict_changed_in_a_nested_function_is_divided_there_too():
    _, result = _rewrite('''
    kw = {"batch_size": args.batch_size}

    def configure():
        if args.big:
            kw["batch_size"] = 64

    configure()
    loader = DataLoader(data, **kw)
''')
    text = result.code.decode()
    assert 'kw = {"batch_size": args.batch_size // world_size}\n' in text
    assert '            kw["batch_size"] = 64 // dist.get_world_size()\n' in text


def test_a_module_level_dict_is_set_before_the_process_group_starts():
    source = '''
import torch
from torch import nn
from torch.utils.data import DataLoader

LOADER = {"batch_size": 16}


def main(data):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, **LOADER)
    for x in loader:
        model(x).sum().backward()
        opt.step()
'''
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions(keep_global_batch=True))
    assert "// dist.get_world_size()" not in result.code.decode()
    [(line, what)] = _differs(result)
    assert line == _line_of(source, "loader = DataLoader(")
    assert f"(line {_line_of(source, 'LOADER = ')}: it is set before the process group starts)" in what

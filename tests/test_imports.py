"""The import adder (rewrite/imports.py): what it adds, where, and that the user's
own import lines stay where they are."""
from __future__ import annotations

from textwrap import dedent

import libcst as cst

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.rewrite.imports import add_imports

SCRIPT = '''
import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset


def main():
    model = nn.Linear(4, 2).cuda()
    opt = optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4)
    for x, y in loader:
        loss = (model(x.cuda()) - y.cuda()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
'''


def added(source: str, *wanted) -> str:
    return add_imports(cst.parse_module(dedent(source)), list(wanted)).code


def test_a_user_import_that_gains_a_name_stays_on_its_line():
    # the user's (unsorted) imports: the device-mesh import comes first
    source = "from torch.distributed.device_mesh import DeviceMesh\n" + dedent(SCRIPT)
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    lines = result.code.decode().splitlines()
    merged = lines.index("from torch.distributed.device_mesh import DeviceMesh, init_device_mesh")
    assert merged < lines.index("import torch")  # still above the imports it preceded


def test_merged_names_are_sorted_and_the_statement_is_not_moved():
    source = """\
        import torch
        from torch.utils.data import TensorDataset
        import torch.nn as nn
    """
    assert added(source, ("torch.utils.data", "DataLoader", None)) == dedent(
        """\
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        import torch.nn as nn
        """
    )


def test_present_imports_are_not_repeated():
    source = """\
        import os
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
    """
    wanted = [("os", None, None), ("torch.distributed", None, "dist"), ("torch.distributed.fsdp", "fully_shard", None)]
    assert added(source, *wanted) == dedent(source)


def test_new_lines_go_to_their_group_in_sorted_order():
    source = """\
        \"\"\"Docstring.\"\"\"
        from __future__ import annotations

        import argparse

        import torch
        from torch import nn
        x = 1
    """
    got = added(source, ("os", None, None), ("torch.distributed", None, "dist"), ("torch.distributed.fsdp", "fully_shard", None))
    assert got == dedent(
        """\
        \"\"\"Docstring.\"\"\"
        from __future__ import annotations

        import argparse
        import os

        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        x = 1
        """
    )


def test_a_file_without_imports_gets_them_after_the_docstring():
    got = added('"""Doc."""\nx = 1\n', ("torch", None, None))
    assert got == '"""Doc."""\nimport torch\n\nx = 1\n'


# libcst's AddImportsVisitor recursed once per statement after a module docstring
# (a RecursionError past about 1,000 statements)


def test_a_module_of_5000_statements_does_not_recurse():
    source = '"""Settings."""\nimport torch\n' + "".join(f"X{i} = {i}\n" for i in range(5000))
    got = added(source, ("torch.distributed", None, "dist"), ("torch.distributed.fsdp", "fully_shard", None))
    assert got.splitlines()[:4] == [
        '"""Settings."""',
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.fsdp import fully_shard",
    ]
    assert got.count("\n") == 5000 + 5  # the docstring, the imports and a blank line before the code


def test_a_script_of_5000_statements_is_rewritten():
    constants = "".join(f"SETTING_{i} = {i}\n" for i in range(5000))
    source = '"""A long script."""' + dedent(SCRIPT).replace("\n\ndef main", "\n" + constants + "\n\ndef main", 1)
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    assert "fully_shard(model" in result.code.decode()
    assert all(1 <= c.line <= source.count("\n") for c in result.changes)

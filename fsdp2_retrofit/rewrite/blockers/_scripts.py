"""Script pieces the blocker cases of several families share: a tiny single-GPU model, its
optimizer and a short loop, with or without a DataLoader. Each piece is whole lines; the comments
say how many, so a case's `line` can be counted."""
from __future__ import annotations

import textwrap

MODEL = "model = torch.nn.Linear(8, 2)\n"
OPT = "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
STEPS = """\
for step in range(10):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
"""
TRAINING = MODEL + OPT + STEPS  # 5 lines
TRAIN = "import torch\n" + TRAINING  # a whole script, 6 lines

CUDA_MODEL = "model = torch.nn.Linear(8, 2).cuda()\n"  # the same, on the GPU (the distributed scripts)
CUDA_STEPS = """\
for step in range(10):
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()
"""

DATA_IMPORTS = "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"  # 2 lines
LOADER = "loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 2)), batch_size=8, shuffle=True)\n"
EPOCH = """\
for x, y in loader:
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
"""  # 4 lines
TRAIN_LOADER = DATA_IMPORTS + MODEL + OPT + LOADER + EPOCH  # a whole script, 9 lines


def indented(text: str) -> str:
    """`text` one level deeper (a function's body)."""
    return textwrap.indent(text, "    ")

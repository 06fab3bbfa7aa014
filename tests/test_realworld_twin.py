"""The corpus harness's deterministic twin (benchmarks/realworld/shim, REALWORLD_DETERMINISTIC=1):
a script with dropout, BatchNorm, noise drawn per batch in the training step (numpy and torch, in
place with normal_, a torch.bernoulli mask) and
random augmentation in its dataset only `trains` as it is, and reaches parity as a twin."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "benchmarks" / "realworld" / "shim"

NOISY = '''
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Jittered(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 6, generator=g)
        self.y = torch.randn(64, 3, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]  # augmentation from the global stream


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6, bias=False)  # a bias before BatchNorm has a zero gradient: Adam amplifies its noise
        self.norm = nn.BatchNorm1d(6)  # each rank's half of the batch on CPU: synchronised in the twin
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(F.relu(self.norm(self.fc(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()
model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
loader = DataLoader(Jittered(), batch_size=args.batch_size, shuffle=True)
for x, y in loader:
    z = torch.from_numpy(np.random.normal(0, 1, (x.shape[0], 6))).float()  # noise drawn per batch
    eps = torch.randn_like(x)
    shift = x.new_empty(x.shape).normal_()  # in place, as Normal.rsample draws
    keep = torch.bernoulli(torch.zeros(x.shape[0], 1) + 0.8)  # a context-drop mask
    loss = F.mse_loss(model(keep * x + 0.1 * z + 0.1 * eps + 0.1 * shift), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"loss {loss.item():.4f}")
'''


def _verify(tmp_path: Path, deterministic: bool) -> dict:
    script = tmp_path / "noisy.py"
    script.write_text(NOISY, encoding="utf-8")
    report = tmp_path / ("twin.json" if deterministic else "row.json")
    env = dict(os.environ, PYTHONPATH=str(SHIM), REALWORLD_SEED="0")
    dtype = ["--dtype", "float64"] if deterministic else []  # as the harness runs a twin
    if deterministic:
        env["REALWORLD_DETERMINISTIC"] = "1"
    proc = subprocess.run([sys.executable, "-m", "fsdp2_retrofit", "verify", str(script), "--steps", "3",
                           "--json", str(report), *dtype, "--", "--batch-size", "16"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert report.is_file(), proc.stderr[-3000:]
    return json.loads(report.read_text(encoding="utf-8"))


@pytest.mark.e2e
def test_the_deterministic_twin_reaches_parity_where_the_row_only_trains(tmp_path: Path):
    pytest.importorskip("numpy")
    row = _verify(tmp_path, deterministic=False)
    twin = _verify(tmp_path, deterministic=True)
    print(f"\nas given: {row['summary']}\ntwin: {twin['summary']}")
    assert not row["equivalent"], "the draws were meant to differ as given (else the test proves nothing)"
    assert twin["equivalent"], twin["summary"]

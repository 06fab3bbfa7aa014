"""FSR8.. resume: loads of sharded state the rewrite cannot turn into DCP (FSR801, FSR802, FSR804, FSR805)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class ResumeLoadBeforeBuild(Blocker):
    """A checkpoint is read before the model or optimizer it fills is built.

    ## Why
    dcp.load fills the state dicts of the sharded model, its optimizer and scheduler: they must
    exist.

    ## What to do
    Build them before loading, then load their state.
    """

    CODE = "FSR801"
    NAME = "resume-load-before-build"
    INVALID = (Invalid(
        """\

import torch
from torch import nn, optim


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks(x))

def main():
    checkpoint = torch.load("ckpt.pt")
    model = Net()
    model.load_state_dict(checkpoint["model"])
    opt = optim.SGD(model.parameters(), lr=0.1)
    opt.load_state_dict(checkpoint["opt"])
    model(torch.ones(4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")

main()
""",
        line=25,
    ),)


class ResumeOptimizerOfSeveralModels(Blocker):
    """A loaded optimizer trains several models.

    ## Why
    get_/set_optimizer_state_dict take the one model the optimizer trains.

    ## What to do
    Give each model its own optimizer.
    """

    CODE = "FSR802"
    NAME = "resume-optimizer-of-several-models"
    # (the script never saves that optimizer's state: a save of it is refused first, FSR706)
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


def main(resume):
    encoder = Net()
    decoder = Net()
    params = list(encoder.parameters()) + list(decoder.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    checkpoint = torch.load(resume)
    encoder.load_state_dict(checkpoint["encoder"])
    decoder.load_state_dict(checkpoint["decoder"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for x in [torch.randn(2, 8)]:
        loss = decoder(encoder(x)).sum()
        loss.backward()
        optimizer.step()
    torch.save({"encoder": encoder.state_dict(), "decoder": decoder.state_dict()}, "last.pt")
""",
        line=19,
    ),)
    # one optimizer per model, each loaded (and saved) with its model
    VALID = (Valid(
        """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


def main(resume):
    encoder = Net()
    decoder = Net()
    enc_opt = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
    dec_opt = torch.optim.AdamW(decoder.parameters(), lr=1e-3)
    checkpoint = torch.load(resume)
    encoder.load_state_dict(checkpoint["encoder"])
    decoder.load_state_dict(checkpoint["decoder"])
    enc_opt.load_state_dict(checkpoint["enc_opt"])
    dec_opt.load_state_dict(checkpoint["dec_opt"])
    for x in [torch.randn(2, 8)]:
        loss = decoder(encoder(x)).sum()
        loss.backward()
        enc_opt.step()
        dec_opt.step()
    torch.save({"encoder": encoder.state_dict(), "decoder": decoder.state_dict(),
                "enc_opt": enc_opt.state_dict(), "dec_opt": dec_opt.state_dict()}, "last.pt")
""",
    ),)


class ResumePickledModuleReload(Blocker):
    """A pickled module (torch.save(model, path)) is reloaded where the tool cannot load it into the
    sharded model: into another name, inside a loop, or before training goes on.

    ## Why
    The save now writes the model's state dict as a DCP directory, so torch.load of it fails.
    Loading into the live sharded model does what the reload did only when nothing trains the model
    after it (the original's optimizer keeps training the module it held); a second model needs its
    own build and sharding.

    ## What to do
    Keep a state dict instead: torch.save(model.state_dict(), path), and to reload, build the model
    (or reuse it) and load_state_dict(torch.load(path)).
    """

    CODE = "FSR804"
    NAME = "resume-pickled-module-reload"
    INVALID = (Invalid(
        '''\
"""Keeps the best model as a pickled module (torch.save(model, path)) and reloads it after
training (model = torch.load(path), then .eval()) for a last evaluation and the final save."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(F.gelu(self.norm(x)))


class Net(nn.Module):
    def __init__(self, dim=32, depth=3):
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@torch.no_grad()
def evaluate(model, x, y):
    model.eval()
    return F.cross_entropy(model(x), y).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--best", default="best.pt")
    parser.add_argument("--out", default="model.pt")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 10, (128,)))
    val_x, val_y = torch.randn(64, 16), torch.randint(0, 10, (64,))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val = evaluate(model, val_x, val_y)
        print(f"epoch {epoch} val {val:.4f}")
        if val < best:
            best = val
            torch.save(model, args.best)
            model = torch.load(args.best, weights_only=False)

    # the best epoch's model, not the last one's
    model.eval()
    print(f"best val {evaluate(model, val_x, val_y):.4f}")
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
''',
        line=69,
    ),)


class ResumeOptimizerNotFollowed(Blocker):
    """An optimizer state is loaded where the tool cannot tell which optimizer receives it: a function
    or object handed different values by its calls (the refusal names the call).

    ## Why
    The load becomes set_optimizer_state_dict(model, optimizer, ...), which needs the one model that
    optimizer trains.

    ## What to do
    Hand the helper the same optimizer (and its model) at every call, or load where the optimizer is
    built.
    """

    CODE = "FSR805"
    NAME = "resume-optimizer-not-followed"
    INVALID = (Invalid(
        '''\
"""Checkpoint helpers outside the code that builds the model and optimizer: the save
reads them as globals, the load is handed them under other names."""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(F.gelu(self.norm(x)))


class Net(nn.Module):
    def __init__(self, dim=32, depth=3):
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def save_checkpoint(step, path):
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)


def load_checkpoint(model, opt, path):
    ckpt = torch.load(path)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return ckpt["step"]


parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--ckpt", default="ckpt.pt")
parser.add_argument("--out", default="model.pt")
args = parser.parse_args()

torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 16), torch.randint(0, 10, (256,)))
loader = DataLoader(data, batch_size=args.batch_size, shuffle=False, drop_last=True)

net = Net()
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)

step = 0
if os.path.exists(args.ckpt):
    step = load_checkpoint(net, optimizer, args.ckpt)
    load_checkpoint(net, torch.optim.SGD(net.parameters()), args.ckpt)
    print(f"resumed from step {step}")

# the data order on resume: skip the batches already seen, by counting steps
while step < args.steps:
    for i, (x, y) in enumerate(loader):
        if step // len(loader) * len(loader) + i < step:
            continue
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        print(f"step {step} loss {loss.item():.4f}")
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(step, args.ckpt)
        if step == args.steps:
            break

torch.save(net.state_dict(), args.out)
''',
        line=65,
    ),)

"""The GPT benchmarks/collectives.py trains: the single-device script a user writes (WORKLOAD)
and FSDP2 written for it by hand, as an expert would (EXPERT), both as text with `# SIZES`
where the module constants go. Both write, per process, `memory-<pid>.json` (state held,
peak RSS) into `--report-dir`; the collectives are counted by collectives.py's wrapper.

EXPERT uses torchtitan's unit layout: the token embedding, each block, `[final norm, head]`
(kept gathered after forward: backward starts with it), then the root; `--blocks-and-root`
switches to the layout this tool generated before (each block, the last kept gathered, then
the root). Data: each rank reads its own part of the same batches (DistributedSampler), the
per-rank batch as in the single-device script, as the generated code does by default.
"""
import textwrap

MODEL = '''\
class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, dim, depth, seq, heads=8):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x)


def held_bytes(model, optimizer):
    """Bytes of parameters, gradients and optimizer state this process holds (local shards, by storage)."""
    seen = set()
    totals = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind, tensor):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            totals[kind] += storage.nbytes()

    for p in model.parameters():
        add("params", p)
        if p.grad is not None:
            add("grads", p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                add("optimizer", value)
    return totals


def report(model, optimizer, folder):
    figures = held_bytes(model, optimizer)
    figures["n_params"] = sum(p.numel() for p in model.parameters())
    figures["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(folder, f"memory-{os.getpid()}.json"), "w") as f:
        json.dump(figures, f)
'''

# Gradient accumulation over ACCUM micro-batches per optimizer step (collectives.py --accumulate):
# the user's loop, and the expert's, which keeps the parameters gathered and the gradients local
# between the non-last micro-batches (set_requires_gradient_sync / set_reshard_after_backward).
_PLAIN_LOOP = '''\
    step = 0
    for x, y in loader:
'''
_LOSS = "        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())"
_UPDATE = "optimizer.step()\n{zero}step += 1\nif step == STEPS:\n    break\n"
_WORKLOAD_STEP = (_LOSS + "\n        optimizer.zero_grad()\n        loss.backward()\n"
                  + textwrap.indent(_UPDATE.format(zero=""), " " * 8))
_ACCUM_LOOP = _PLAIN_LOOP.replace("for x, y in loader:", "for i, (x, y) in enumerate(loader):")
_ACCUM_STEP = (_LOSS + " / ACCUM\n        loss.backward()\n        if (i + 1) % ACCUM == 0:\n"
               + textwrap.indent(_UPDATE.format(zero="optimizer.zero_grad()\n"), " " * 12))
_EXPERT_HOLD = '''\
        last = (i + 1) % ACCUM == 0
        model.set_requires_gradient_sync(last)  # reduce-scatter on the last micro-batch only
        model.set_reshard_after_backward(last)  # keep the parameters gathered until then
'''



WORKLOAD = '''\
"""Benchmark workload: a GPT trained with AdamW on random tokens for a few steps; reports its memory."""
import argparse
import json
import os
import resource

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# SIZES


''' + MODEL + '''

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--report-dir", default=".")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = torch.randint(0, VOCAB, (64 * BATCH, SEQ + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH, shuffle=False)

    model = GPT(VOCAB, DIM, DEPTH, SEQ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

''' + _PLAIN_LOOP + '''        x, y = x.to(device), y.to(device)
''' + _WORKLOAD_STEP + '''    report(model, optimizer, args.report_dir)


if __name__ == "__main__":
    main()
'''

EXPERT = '''\
"""Hand-written FSDP2 of the benchmark GPT, torchtitan's unit layout (or blocks + root)."""
import argparse
import json
import os
import resource

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# SIZES


''' + MODEL + '''

def parallelize(model, mesh, blocks_and_root):
    if blocks_and_root:  # the layout generated before: blocks, the last one kept gathered, then the root
        for i, block in enumerate(model.blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)
        fully_shard(model, mesh=mesh)
        return
    fully_shard(model.tok_emb, mesh=mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    # backward starts with the head: resharding it after forward would only gather it again
    fully_shard([model.norm, model.head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--report-dir", default=".")
    parser.add_argument("--blocks-and-root", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (64 * BATCH, SEQ + 1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))

    model = GPT(VOCAB, DIM, DEPTH, SEQ)  # the same seed on every rank: the same weights
    parallelize(model, mesh, args.blocks_and_root)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

''' + _PLAIN_LOOP + _WORKLOAD_STEP + '''    report(model, optimizer, args.report_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def accumulating(script: str, expert: bool) -> str:
    """WORKLOAD or EXPERT with ACCUM micro-batches per optimizer step."""
    script = _replace_once(script, _PLAIN_LOOP, _ACCUM_LOOP + (_EXPERT_HOLD if expert else ""))
    return _replace_once(script, _WORKLOAD_STEP, _ACCUM_STEP)


WORKLOAD_ACCUM = accumulating(WORKLOAD, expert=False)
EXPERT_ACCUM = accumulating(EXPERT, expert=True)

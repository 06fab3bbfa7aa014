"""How the loss that reaches backward() is reduced (fsdp2_retrofit/analysis/loss_reduction.py)
and the loss_scale stage that reads it: a loss summed over the batch gets its backward
scaled by the world size, a sum mixed with a mean is refused (FSR960), the rest is left
alone; where the rewrite splits no training data (a full-batch tensor) the backward is left
unscaled and reported (analysis/data_split.py). The execution proofs are
fixtures/rewrite/sum_reduced_loss, sum_loss_global_criterion, sum_loss_legacy_criterion
and sum_loss_full_batch."""
from __future__ import annotations

from textwrap import dedent

import libcst as cst
import pytest

from fsdp2_retrofit.analysis.loss_reduction import BATCHED, MEAN, MIXED, SUM, UNKNOWN, loss_reductions
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import Resolver


def kinds(source: str) -> list:
    resolver = Resolver(cst.parse_module(dedent(source)))
    return [found.kind for found in loss_reductions(resolver)]


def terms(source: str) -> list:
    resolver = Resolver(cst.parse_module(dedent(source)))
    return [[(t.kind, resolver.line(t.node)) for t in found.terms] for found in loss_reductions(resolver)]


HEAD = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
"""


@pytest.mark.parametrize("loss", [
    "F.mse_loss(out, y, reduction='sum')",
    "F.binary_cross_entropy(out, y, size_average=False)",
    "torch.sum((out - y) ** 2)",
    "(out - y).pow(2).sum()",
    "F.mse_loss(out, y, reduction='none').sum()",
    "-0.5 * torch.sum(1 + out - y.pow(2))",
    "F.l1_loss(out, y, reduction='sum') / 2",
    "torch.sum(1 + out - y.pow(2)).mul_(-0.5)",
    "(out - y).pow(2).sum().div(2)",
    "torch.sum(out - y).neg()",
])
def test_a_loss_summed_over_the_batch_is_sum(loss):
    assert kinds(HEAD + f"loss = {loss}\nloss.backward()\n") == [SUM]


@pytest.mark.parametrize("loss", [
    "F.cross_entropy(out, y)",
    "F.mse_loss(out, y, reduction='mean')",
    "F.kl_div(out, y, reduction='batchmean')",
    "F.binary_cross_entropy(out, y, size_average=True)",
    "torch.mean((out - y) ** 2)",
    "F.mse_loss(out, y, reduction='none').mean()",
    "F.cross_entropy(out, y).sum()",  # a sum of a scalar mean is that mean
    "-torch.mean(discriminator(x))",  # a mean of a model's outputs, or of a loss: a mean either way
])
def test_a_loss_averaged_over_the_batch_is_mean(loss):
    assert kinds(HEAD + f"loss = {loss}\nloss.backward()\n") == [MEAN]


@pytest.mark.parametrize("loss", [
    "model(x).loss",  # a library model's own loss
    "compute(out, y)",  # a function that is not the script's
    "F.mse_loss(out, y, reduction=mode)",  # the reduction is not known
    "F.mse_loss(out, y, reduction='sum') / x.size(0)",  # normalised by the batch size
    "torch.stack([F.mse_loss(a, y) for a in outs]).sum()",  # a sum of losses kept in a list
    "F.cross_entropy(out, y) + 1e-4 * model.fc.weight.pow(2).sum()",  # a weight penalty, not over the batch
    "F.mse_loss(out, y, reduction='none')",  # not a scalar
    "F.mse_loss(out, y, reduction='sum') * world_size",  # scaled already
    "F.mse_loss(out, y, reduction='sum') * dist.get_world_size()",
    "criterion(out, y).sum()",  # what an unread criterion returns may be a mean already
    "model(x).sum()",
    "self.loss_fn(out, y).sum()",
])
def test_what_cannot_be_read_is_unknown(loss):
    assert kinds(HEAD + f"loss = {loss}\nloss.backward()\n") == [UNKNOWN]


def test_a_sum_added_to_a_mean_is_mixed_and_names_both_lines():
    source = HEAD + """\
recon = F.mse_loss(out, y)
kl = -0.5 * torch.sum(1 + logv - mu.pow(2) - logv.exp())
loss = recon + beta * kl
loss.backward()
"""
    assert kinds(source) == [MIXED]
    assert terms(source) == [[("mean", 4), ("sum", 5)]]


def test_the_vae_shape_follows_names_criteria_and_the_scripts_function():
    source = HEAD + """\
criterion = nn.MSELoss(reduction="sum")


def loss_function(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x, size_average=False)
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def train(model, loader, optimizer, scaler):
    for x in loader:
        recon, mu, logvar = model(x)
        loss = loss_function(recon, x, mu, logvar)
        loss += criterion(recon, x)
        loss = loss / 4
        scaler.scale(loss).backward()
"""
    assert kinds(source) == [SUM]
    assert terms(source) == [[("sum", 8), ("sum", 9), ("sum", 17)]]


@pytest.mark.parametrize("built", ['nn.MSELoss(reduction="sum")', "nn.MSELoss(size_average=False)"])
def test_a_module_level_criterion_read_in_the_scripts_function_plus_a_scaled_sum_is_sum(built):
    source = HEAD + f"""\
reconstruction_function = {built}


def loss_function(recon_x, x, mu, logvar):
    rec = reconstruction_function(recon_x, x)
    element = mu.pow(2).add_(logvar.exp()).mul_(-1).add_(1).add_(logvar)
    kld = torch.sum(element).mul_(-0.5)
    return rec + kld


for x in loader:
    recon, mu, logvar = model(x)
    loss = loss_function(recon, x, mu, logvar)
    loss.backward()
"""
    assert kinds(source) == [SUM]
    assert terms(source) == [[("sum", 8), ("sum", 10)]]


@pytest.mark.parametrize("factor", ["n", "out.size(0)"])
def test_a_sum_divided_by_a_value_not_known_by_a_method_is_unknown(factor):
    assert kinds(HEAD + f"torch.sum(out - y).div({factor}).backward()\n") == [UNKNOWN]


def test_a_criterion_with_the_default_reduction_is_mean_and_a_parameter_is_unknown():
    source = HEAD + """\
criterion = nn.CrossEntropyLoss()


def step(out, y, loss_fn):
    criterion(out, y).backward()
    loss_fn(out, y).backward()
"""
    assert kinds(source) == [MEAN, UNKNOWN]


# -- the loss_scale stage -------------------------------------------------------

SCRIPT = '''from torch.utils.data import DataLoader, TensorDataset
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def main():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler()
    loader = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=8)
    for (x,) in loader:
        out = model(x)
        {body}
        opt.step()


if __name__ == "__main__":
    main()
'''


def rewrite(body: str):
    return rewrite_source(dedent(SCRIPT.format(body=body)).encode(), "train.py", RetrofitOptions())


def backward_lines(result) -> list:
    return [line.strip() for line in result.code.decode().splitlines() if "backward" in line]


def test_a_summed_loss_has_its_backward_scaled_and_the_loss_kept():
    result = rewrite("loss = F.mse_loss(out, x, reduction='sum')\n        loss.backward()")
    assert not result.refusals, result.refusals
    assert backward_lines(result) == ["(loss * world_size).backward()"]
    assert "loss = F.mse_loss(out, x, reduction='sum')" in result.code.decode()
    change = next(c for c in result.changes if c.code == "loss_scale")
    assert change.line == 25 and "averages gradients over the ranks" in change.why
    assert "line 24" in change.what


def test_through_a_grad_scaler_the_scaled_loss_is_the_product():
    result = rewrite("loss = (out - x).pow(2).sum()\n        scaler.scale(loss).backward(retain_graph=True)")
    assert backward_lines(result) == ["scaler.scale(loss * world_size).backward(retain_graph=True)"]


def test_a_backward_in_a_helper_reads_the_world_size_of_the_process_group():
    code = SCRIPT.replace("        {body}\n", "        step_once(out, x)\n").replace(
        "def main():", "def step_once(out, x):\n    torch.sum((out - x) ** 2).backward()\n\n\ndef main():"
    )
    result = rewrite_source(dedent(code).encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    assert backward_lines(result) == ["(torch.sum((out - x) ** 2) * dist.get_world_size()).backward()"]
    assert "import torch.distributed as dist" in result.code.decode()


def test_a_mean_loss_is_left_alone():
    result = rewrite("loss = F.mse_loss(out, x)\n        loss.backward()")
    assert backward_lines(result) == ["loss.backward()"]
    assert not [c for c in result.changes if c.code == "loss_scale"]


def test_a_sum_mixed_with_a_mean_is_refused_at_the_sum():
    result = rewrite(
        "recon = F.mse_loss(out, x)\n        kl = 0.5 * torch.sum(out.pow(2))\n"
        "        loss = recon + kl\n        loss.backward()"
    )
    assert [r.code for r in result.refusals] == ["FSR960"]
    refusal = result.refusals[0]
    assert refusal.line == 25 and "summed over the batch" in refusal.what and "line 24" in refusal.what


def test_the_rewrite_of_the_output_scales_nothing_again():
    first = rewrite("loss = F.mse_loss(out, x, reduction='sum')\n        loss.backward()")
    second = rewrite_source(first.code, "train.py", RetrofitOptions())
    assert second.code == first.code and second.changes == []


# -- whether the data is split between the ranks (analysis/data_split.py) --------

FULL_BATCH = SCRIPT.replace(
    "    loader = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=8)\n    for (x,) in loader:\n",
    "    x = torch.randn(8, 4)\n    for step in range(3):\n",
)


def test_a_summed_loss_on_data_no_rank_splits_is_left_unscaled_and_reported():
    assert FULL_BATCH != SCRIPT
    code = FULL_BATCH.format(body="loss = F.mse_loss(out, x, reduction='sum')\n        loss.backward()")
    result = rewrite_source(dedent(code).encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    assert backward_lines(result) == ["loss.backward()"]
    assert not [c for c in result.changes if c.code == "loss_scale"]
    [item] = [a for a in result.attention if a.code == "loss_scale"]
    assert item.line == 25 and item.what.startswith("FSD119: ") and "left unscaled" in item.what and "line 24" in item.what
    assert "not split between the ranks" in item.what and "no DataLoader" in item.what


def test_a_loader_no_training_loop_reads_keeps_the_scale_and_says_it_is_not_known():
    code = FULL_BATCH.replace(
        "    x = torch.randn(8, 4)\n",
        "    x = torch.randn(8, 4)\n    val = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=8)\n",
    ).format(body="loss = F.mse_loss(out, x, reduction='sum')\n        loss.backward()")
    result = rewrite_source(dedent(code).encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    assert backward_lines(result) == ["(loss * world_size).backward()"]
    change = next(c for c in result.changes if c.code == "loss_scale")
    assert "is not known" in change.what and "scaled as if" in change.what


# -- with the script's facts: batch sizes read from the batch, forwards of the script's classes (issue 44, class 5)

OBJECTIVE = '''from torch.utils.data import DataLoader, TensorDataset
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Objective(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        {forward}


def main():
    torch.manual_seed(0)
    model = Net()
    objective = Objective(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 8
    loader = DataLoader(TensorDataset(torch.randn(24, 4), torch.randn(24, 4)), batch_size=n)
    for x, y in loader:
        out = model(x)
        {body}
        opt.step()


if __name__ == "__main__":
    main()
'''


def read_with_facts(body: str, forward: str = "return F.mse_loss(self.net(x), y, reduction='none')"):
    from fsdp2_retrofit.analysis.facts import analyse

    module = cst.parse_module(dedent(OBJECTIVE.format(body=body, forward=forward)))
    facts = analyse(module, "train.py")
    return [(found.kind, found.power) for found in loss_reductions(facts.resolver, facts)]


@pytest.mark.parametrize("body, expected", [
    ("(out - y).pow(2).sum().div(x.size(0)).backward()", (MEAN, 1)),
    ("loss = torch.sum((out - y) ** 2) / x.shape[0]\n        loss.backward()", (MEAN, 1)),
    ("b = len(x)\n        loss = (out - y).pow(2).sum() / (b * b)\n        loss.backward()", (BATCHED, 2)),
    ("B, D = x.shape\n        loss = (out - y).pow(2).sum() / B ** 3\n        loss.backward()", (BATCHED, 3)),
    ("loss = F.mse_loss(out, y) * x.size(0)\n        loss.backward()", (SUM, 0)),
    ("loss = objective(x, y).sum()\n        loss.backward()", (SUM, 0)),
    ("loss = objective(x, y).mean()\n        loss.backward()", (MEAN, 1)),
    ("loss = objective(x, y).sum() / x.size(0) ** 2.\n        loss.backward()", (BATCHED, 2)),
])
def test_batch_sizes_and_a_modules_per_sample_losses_are_read(body, expected):
    assert read_with_facts(body) == [expected]


@pytest.mark.parametrize("body, forward", [
    ("((out - y).pow(2).sum() / len(loader)).backward()", None),  # the number of batches, not a batch size
    ("((out - y).pow(2).sum() / x.size(1)).backward()", None),  # the features, not the samples
    ("((out - y).pow(2).sum() / model.fc.weight.size(0)).backward()", None),  # a weight's rows
    ("objective(x, y).sum().backward()", "return self.net(x)"),  # what the forward gives is not a loss it reads
])
def test_what_is_not_a_batch_size_or_a_read_loss_stays_unknown(body, forward):
    kwargs = {"forward": forward} if forward else {}
    assert read_with_facts(body, **kwargs) == [(UNKNOWN, None)]


def test_a_forward_returning_a_mean_keeps_the_mean_and_powers_that_differ_are_mixed():
    assert read_with_facts("objective(x, y).backward()", forward="return F.mse_loss(self.net(x), y)") == [(MEAN, 1)]
    assert read_with_facts("(objective(x, y).sum() / x.size(0) ** 2 + F.mse_loss(out, y)).backward()") == [(MIXED, None)]


def rewrite_objective(body: str, forward: str = "return F.mse_loss(self.net(x), y, reduction='none')"):
    return rewrite_source(dedent(OBJECTIVE.format(body=body, forward=forward)).encode(), "train.py", RetrofitOptions())


@pytest.mark.parametrize("body, expected", [
    ("loss = objective(x, y).sum() / x.size(0) ** 2\n        loss.backward()", "(loss / world_size).backward()"),
    ("(objective(x, y).sum() / len(x) ** 3).backward()",
     "((objective(x, y).sum() / len(x) ** 3) / world_size ** 2).backward()"),
    ("loss = objective(x, y).sum()\n        loss.backward()", "(loss * world_size).backward()"),
    ("loss = objective(x, y).sum() / x.size(0)\n        loss.backward()", "loss.backward()"),
])
def test_the_backward_is_scaled_by_world_size_to_one_less_the_power(body, expected):
    result = rewrite_objective(body)
    assert not result.refusals, result.refusals
    assert backward_lines(result) == [expected]


def test_a_sum_and_a_sum_over_the_batch_size_squared_are_refused_naming_both():
    result = rewrite_objective(
        "loss = objective(x, y).sum() / x.size(0) ** 2 + F.mse_loss(out, y, reduction='sum')\n        loss.backward()")
    [refusal] = result.refusals
    assert refusal.code == "FSR960" and "summed over the batch," in refusal.what
    assert "divided by the batch size to the power 2" in refusal.what


def test_a_sum_over_an_unread_call_is_reported_at_the_sum():
    result = rewrite_objective("loss = objective(x, y).sum()\n        loss.backward()", forward="return self.net(x)")
    assert backward_lines(result) == ["loss.backward()"]
    [item] = [a for a in result.attention if a.code == "loss_scale"]
    assert item.line == 34 and "cannot read" in item.what and "line 35" in item.what


def test_a_regulariser_over_a_weight_held_by_a_name_is_no_sum_over_the_batch():
    """`w = model.fc.weight; (w @ w.T).sum()` sums over the weights, not the batch: no FSR960 beside a mean."""
    result = rewrite("w = model.fc.weight\n        loss = F.mse_loss(out, x) + 1e-3 * (w @ w.T).sum()\n"
                     "        loss.backward()")
    assert not result.refusals, result.refusals
    assert backward_lines(result) == ["loss.backward()"]

"""verify tells round-off from divergence: by dtype, by the optimizer's step size, and in float64.

The units (no processes) cover the bands: bfloat16 values a spacing apart agree, a
parameter Adam moved by round-off within its step bound is spared only when every step
(and the parameter's own gradient norm) agrees, and a tensor outside its band is named by
its qualified name with its first element off. The e2e tests run verify's own fixture,
fixtures/verify/attention_adam.py: two attention blocks trained with Adam for 20 steps, whose
key biases have a gradient of zero in exact arithmetic. `pytest -s` prints the figures.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.verify import (
    COMPARE_SCRIPT,
    EXIT_DIVERGED,
    EXIT_EQUIVALENT,
    RULES,
    RoundOff,
    Run,
    Verdict,
    WeightsResult,
    close,
    compare_runs,
    compare_steps,
    compare_weights,
    float64_notes,
)
from fsdp2_retrofit.verify import bands

REPO = Path(__file__).resolve().parents[1]
ATTENTION = REPO / "fixtures" / "verify" / "attention_adam.py"
STEPS = 20
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


# --- units ------------------------------------------------------------------------------


def test_bfloat16_values_a_spacing_apart_agree_float32_ones_do_not():
    assert bands.ulp(11.0, "bfloat16") == 0.0625 and bands.ulp(0.75, "float16") == 2.0 ** -11
    assert close(11.0, 11.0625, 1e-4, 1e-5, "bfloat16")  # 1 ulp
    assert not close(11.0, 11.25, 1e-4, 1e-5, "bfloat16")  # 4 ulps
    assert not close(11.0, 11.0625, 1e-4, 1e-5, "float32") and not close(11.0, 11.0625, 1e-4, 1e-5)
    single = {"losses": [11.0, 10.5], "grad_norms": [3.0, 2.5], "loss_dtype": "bfloat16", "grad_dtype": "bfloat16"}
    ranks = [{"losses": [11.0625, 10.5], "grad_norms": [3.0, 2.5078125], "loss_dtype": "bfloat16"},
             {"losses": [11.0625, 10.5], "grad_norms": [3.0, 2.5078125], "loss_dtype": "bfloat16"}]
    assert not any(r.problem for r in compare_steps(single, ranks))
    as_float32 = {**single, "loss_dtype": "float32", "grad_dtype": "float32"}
    assert compare_steps(as_float32, [{**r, "loss_dtype": "float32"} for r in ranks])[0].problem.startswith("loss")


def test_a_float32_loss_computed_under_bfloat16_autocast_is_judged_in_bfloat16():
    single = {"losses": [2.84463], "grad_norms": [1.5], "loss_dtype": "float32", "grad_dtype": "float32",
              "compute_dtype": "bfloat16"}
    ranks = [{"losses": [2.84506], "grad_norms": [1.51], "loss_dtype": "float32", "compute_dtype": "bfloat16"}]
    assert not compare_steps(single, ranks)[0].problem
    as_float32 = {**single, "compute_dtype": "float32"}
    assert compare_steps(as_float32, [{**ranks[0], "compute_dtype": "float32"}])[0].problem.startswith("loss")
    # a parameter's gradient norm 0.7% apart: bfloat16 round-off, beyond float32's
    norms = ({"param_grad_norms": [[0.04325]], "grad_norms": [1.0], "compute_dtype": "bfloat16"},
             {"param_grad_norms": [[0.04354]]})
    assert bands.gradient_departure(0, *norms) is None
    assert bands.gradient_departure(0, {**norms[0], "compute_dtype": "float32"}, norms[1]).startswith("step 1")


def _compare_module():
    spec = importlib.util.spec_from_file_location("_fsdp2_verify_compare", COMPARE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_torch
def test_bfloat16_weights_a_spacing_apart_are_equivalent_by_the_dtype_rule():
    import torch

    row = _compare_module()._row
    band = {"tolerance": 1e-4, "ulps": bands.DTYPE_ULPS}
    single = torch.tensor([[11.0, 0.5], [2.0, -3.0]], dtype=torch.bfloat16)
    one_ulp = torch.tensor([[11.0625, 0.5], [2.0, -3.0]], dtype=torch.bfloat16)
    result = compare_weights({"count": [1, 1], "tensors": [row(0, single, one_ulp, band=band)]}, 1e-4)
    assert result.ok and result.rule == "dtype resolution" and result.max_abs_diff == 0.0625
    four = torch.tensor([[11.0, 0.5], [2.0, -3.125]], dtype=torch.bfloat16)  # 4 ulps at 3.0
    params = [{"name": "blocks.0.norm.weight", "optimizer": "SGD", "lr_sum": 0.1, "dtype": "bfloat16"}]
    bad = compare_weights({"count": [1, 1], "tensors": [row(0, single, four, band=band)]}, 1e-4, RoundOff(params))
    assert not bad.ok and bad.worst_name == "blocks.0.norm.weight"
    assert "'blocks.0.norm.weight'" in bad.problem and "first element off the band at [1, 1]" in bad.problem
    assert bad.first_over["index"] == [1, 1]


def _row(index, diff, over=3, shape=(96,)):
    return {"index": index, "shape_single": list(shape), "shape_dist": list(shape), "dtype": "float32",
            "max_abs_diff": diff, "over": over, "max_ulps": 1e6,
            "first_over": {"index": [36], "single": -2.2e-4, "dist": -2.8e-5, "diff": 1.9e-4, "allowed": 1e-4}}


ADAM = {"optimizer": "Adam", "lr_sum": 0.02, "steps": 20, "betas": [0.9, 0.999], "dtype": "float32"}


def _records(norms_single, norms_dist):
    return ({"param_grad_norms": norms_single, "grad_norms": [1.0] * len(norms_single)},
            {"param_grad_norms": norms_dist})


def test_adam_round_off_within_its_step_bound_is_spared_only_after_agreeing_steps():
    params = [{**ADAM, "name": "embed.weight"}, {**ADAM, "name": "blocks.1.attn.in_proj_bias"}]
    summary = {"count": [2, 2], "tensors": [_row(0, 1e-6, over=0), _row(1, 4e-4)]}
    single, dist = _records([[0.5, 1e-8]] * 3, [[0.5, 3e-8]] * 3)
    spared = compare_weights(summary, 1e-4, RoundOff(params, single, dist, steps_agree=True))
    assert spared.ok and spared.rule == "optimizer step bound"
    assert "'blocks.1.attn.in_proj_bias' off by 4.000e-04" in spared.rule_detail and "bound 0.126" in spared.rule_detail
    # the same weights after a step that disagreed: diverged, named by the qualified name
    steps_apart = compare_weights(summary, 1e-4, RoundOff(params, single, dist, steps_agree=False))
    assert not steps_apart.ok and "'blocks.1.attn.in_proj_bias'" in steps_apart.problem
    assert "first element off the band at [36]" in steps_apart.problem
    # beyond the bound
    far = compare_weights({"count": [2, 2], "tensors": [_row(0, 0.0, over=0), _row(1, 0.2)]}, 1e-4,
                          RoundOff(params, single, dist, steps_agree=True))
    assert not far.ok and "beyond the optimizer's step bound" in far.problem
    # SGD's step is lr * gradient: nothing to spare
    sgd = [{**p, "optimizer": "SGD"} for p in params]
    assert not compare_weights(summary, 1e-4, RoundOff(sgd, single, dist, steps_agree=True)).ok
    # the parameter's own gradient differed (a real difference the total norm hid): diverged, at that step
    moved = _records([[0.5, 0.2]] * 3, [[0.5, 0.2], [0.5, 0.2], [0.5, 0.25]])
    departed = compare_weights(summary, 1e-4, RoundOff(params, *moved, steps_agree=True))
    assert not departed.ok and "its gradient first differed at step 3" in departed.problem


def _saved(name, diff, over=3):
    return {**_row(0, diff, over=over), "name": name}


def test_a_saved_parameter_is_spared_by_the_same_step_bound_as_the_final_weights():
    params = [{**ADAM, "name": "embed.weight"}, {**ADAM, "name": "blocks.1.attn.in_proj_bias"}]
    single, dist = _records([[0.5, 1e-8]] * 3, [[0.5, 3e-8]] * 3)
    agree = RoundOff(params, single, dist, steps_agree=True)
    # by its key: the qualified name, under a prefix (several state dicts saved, DDP's module.), or compiled
    for key in ("blocks.1.attn.in_proj_bias", "model.blocks.1.attn.in_proj_bias",
                "module._orig_mod.blocks.1.attn.in_proj_bias"):
        spared = compare_weights({"count": [1, 1], "tensors": [_saved(key, 4e-4)]}, 1e-4, agree)
        assert spared.ok and spared.rule == "optimizer step bound", key
        assert f"'{key}' off by 4.000e-04" in spared.rule_detail and spared.worst_name == key
    # not after a step that disagreed, not beyond the bound, not a buffer or an optimizer's state
    steps_apart = RoundOff(params, single, dist, steps_agree=False)
    assert not compare_weights({"count": [1, 1], "tensors": [_saved("blocks.1.attn.in_proj_bias", 4e-4)]},
                               1e-4, steps_apart).ok
    far = compare_weights({"count": [1, 1], "tensors": [_saved("blocks.1.attn.in_proj_bias", 0.2)]}, 1e-4, agree)
    assert not far.ok and "beyond the optimizer's step bound" in far.problem
    assert "'blocks.1.attn.in_proj_bias'" in far.problem
    for key in ("blocks.1.norm.running_mean", "state.1.exp_avg", "1.attn.in_proj_bias_other"):
        assert not compare_weights({"count": [1, 1], "tensors": [_saved(key, 4e-4)]}, 1e-4, agree).ok, key
    # a key two models' parameters share (a GAN's generator and discriminator): within the bound of
    # each, and neither's gradient departed
    gan = [{**ADAM, "name": "main.0.weight"}, {**ADAM, "name": "main.0.weight", "lr_sum": 1e-5}]
    near = {"count": [1, 1], "tensors": [_saved("main.0.weight", 4e-4)]}
    assert not compare_weights(near, 1e-4, RoundOff(gan, single, dist, steps_agree=True)).ok  # the other bound, 6.3e-05: no
    assert compare_weights(near, 1e-4, RoundOff([gan[0], gan[0]], single, dist, steps_agree=True)).ok
    moved = _records([[0.5, 0.2]] * 3, [[0.5, 0.2], [0.5, 0.2], [0.5, 0.25]])
    assert not compare_weights(near, 1e-4, RoundOff([gan[0], gan[0]], *moved, steps_agree=True)).ok


def test_compare_runs_judges_the_saved_files_with_the_runs_step_bound(tmp_path: Path):
    record = {"losses": [2.0, 1.5, 1.2], "grad_norms": [1.0, 0.9, 0.8], "param_grad_norms": [[0.5, 1e-8]] * 3,
              "params": [{**ADAM, "name": "embed.weight"}, {**ADAM, "name": "blocks.1.attn.in_proj_bias"}]}
    single, dist = Run(tmp_path, [record], None), Run(tmp_path, [record, record], None)
    summary = {"count": [2, 2], "tensors": [_saved("embed.weight", 1e-6, over=0),
                                            {**_saved("blocks.1.attn.in_proj_bias", 4e-4), "index": 1}]}
    judged_alone = compare_weights(summary, 1e-4)
    assert not judged_alone.ok  # compare_saved without the runs: no step bound to spare it by
    judged_alone.summary, judged_alone.tolerance = summary, 1e-4
    verdict = compare_runs(single, dist, saved=judged_alone)
    assert verdict.saved.ok and verdict.saved.rule == "optimizer step bound" and verdict.equivalent
    # the runs' steps apart: the saved files are not spared either
    apart = Run(tmp_path, [{**record, "losses": [2.0, 1.6, 1.3]}] * 2, None)
    assert not compare_runs(single, apart, saved=judged_alone).saved.ok
    # a result without its summary (built by hand) is kept as it is
    kept = WeightsResult(False, 4e-4, 1, 2, 2, "differs")
    assert compare_runs(single, dist, saved=kept).saved is kept


def test_compare_saved_given_the_runs_spares_a_saved_parameter_by_its_step_bound(tmp_path: Path):
    import torch

    from fsdp2_retrofit.verify import compare_saved

    record = {"losses": [2.0, 1.5], "grad_norms": [1.0, 0.9], "param_grad_norms": [[1e-8]] * 2,
              "params": [{**ADAM, "name": "attn.in_proj_bias"}]}
    single, dist = Run(tmp_path, [record], None), Run(tmp_path, [record, record], None)
    bias = torch.zeros(8)
    torch.save({"model": {"attn.in_proj_bias": bias}}, tmp_path / "single.pt")
    torch.save({"model": {"attn.in_proj_bias": bias + 4e-4}}, tmp_path / "dist.pt")
    alone = compare_saved(tmp_path / "single.pt", tmp_path / "dist.pt", ["model"], 1e-4)
    assert not alone.ok and "'attn.in_proj_bias'" in alone.problem
    given = compare_saved(tmp_path / "single.pt", tmp_path / "dist.pt", ["model"], 1e-4, runs=(single, dist))
    assert given.ok and given.rule == "optimizer step bound"


def test_a_float64_run_killed_by_sigkill_is_said_to_be_out_of_memory_not_a_script_that_cannot():
    from fsdp2_retrofit.verify import VerifyError, float64_failure

    killed = float64_failure(VerifyError("the distributed run failed (exit code 1)",
                                         "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 16937)  (SIGKILL)\n"
                                         "  traceback : Signal 9 (SIGKILL) received by PID 16937"))
    assert "out of memory" in killed.message and "may not run in float64" not in killed.message
    raised = float64_failure(VerifyError("the distributed run failed (exit code 1)",
                                         "RuntimeError: expected scalar type Double but found Float"))
    assert "may not run in float64" in raised.message and "out of memory" not in raised.message


def test_a_float64_parameter_is_not_spared_by_the_step_bound():
    # pytorch-gan/relativistic_gan's float64 twin: each rank's batch mean of the other side's logits moved
    # 'model.11.weight' by 2.7e-4 while the losses agreed to 1e-7; in float64 that is no round-off
    params = [{**ADAM, "dtype": "float64", "name": "model.11.weight"}]
    single, dist = _records([[0.5]] * 3, [[0.5]] * 3)
    summary = {"count": [1, 1], "tensors": [{**_row(0, 2.7e-4), "dtype": "float64"}]}
    judged = compare_weights(summary, 1e-4, RoundOff(params, single, dist, steps_agree=True))
    assert not judged.ok and "'model.11.weight'" in judged.problem
    assert bands.step_bound(params[0]) is None
    assert bands.step_bound({**params[0], "eps": 1e-16}) is not None  # an eps below float64's round-off


def test_the_step_bound_follows_the_optimizer():
    assert bands.step_bound({"optimizer": "AdamW", "lr_sum": 0.01, "betas": [0.9, 0.999]}) == pytest.approx(
        2 * 0.01 * 0.1 / 0.001 ** 0.5)
    assert bands.step_bound({"optimizer": "Adam", "lr_sum": 0.01, "betas": [0.5, 0.5]}) == pytest.approx(0.02)
    assert bands.step_bound({"optimizer": "RMSprop", "lr_sum": 0.01, "alpha": 0.99}) == pytest.approx(0.2)
    assert bands.step_bound({"optimizer": "SGD", "lr_sum": 0.01}) is None
    assert bands.step_bound({"optimizer": "Adam", "lr_sum": float("nan")}) is None


def test_the_verdict_says_which_rule_decided_and_names_the_worst_parameter_after_a_diverging_step():
    params = [{**ADAM, "name": "head.bias"}]
    single = {"losses": [2.0, 1.5], "grad_norms": [1.0, 0.9], "param_grad_norms": [[0.1], [0.1]]}
    same = [{"losses": [2.0, 1.5], "grad_norms": [1.0, 0.9], "param_grad_norms": [[0.1], [0.1]]}]
    spared = compare_weights({"count": [1, 1], "tensors": [_row(0, 4e-4)]}, 1e-4,
                             RoundOff(params, single, same[0], steps_agree=True))
    verdict = Verdict(compare_steps(single, same), spared, single, same)
    assert verdict.equivalent and "(rule: optimizer step bound)" in verdict.summary()
    apart = [{**same[0], "losses": [2.1, 1.6]}]
    far = compare_weights({"count": [1, 1], "tensors": [_row(0, 3e-2)]}, 1e-4, RoundOff(params, single, apart[0]))
    diverged = Verdict(compare_steps(single, apart), far, single, apart)
    assert diverged.summary().startswith("diverged at step 1: loss")
    assert "the final weights differ most in 'head.bias' (by 3.000e-02)" in diverged.summary()


def test_float64_notes_name_what_stayed_in_a_lower_precision():
    single = {"params": [{"name": "w", "dtype": "float64"}, {"name": "emb.weight", "dtype": "float32"}],
              "loss_dtype": "float64", "grad_dtype": "float32"}
    notes = float64_notes(single, [{"params": [{"name": "w", "dtype": "float64"}], "loss_dtype": "float64"}])
    assert notes[0].startswith("--dtype float64: 1 of 2 parameters of the single run stayed in a lower precision "
                               "(emb.weight (float32))")
    assert "computed its gradients in float32" in notes[1] and len(notes) == 2


# --- real runs --------------------------------------------------------------------------


def _verify(tmp_path: Path, *args) -> tuple:
    report = tmp_path / "report.json"
    result = CliRunner().invoke(cli.main, ["verify", "--json", str(report), *map(str, args)])
    return result.exit_code, result.output, json.loads(report.read_text()) if report.is_file() else {}


def _figures(name: str, report: dict) -> str:
    w = report.get("weights") or {}
    return (f"\n{name}: exit {report.get('exit_code')}, {report.get('summary')}; max weight diff "
            f"{w.get('max_abs_diff')} in {w.get('worst_name')}, rule {w.get('rule')}, max loss diff "
            f"{report.get('max_loss_diff')}")


@needs_torch
@pytest.mark.e2e
def test_attention_trained_with_adam_is_equivalent_at_the_defaults(tmp_path: Path):
    """In float32 the key biases end up to ~4e-4 apart (measured: 3.99e-4 in blocks.0.attn.in_proj_bias,
    elements 32..63, the key part) while all 20 steps agree to 3e-7: round-off Adam amplified."""
    code, output, report = _verify(tmp_path, ATTENTION, "--steps", STEPS)
    print(_figures("attention + Adam, float32", report))
    assert code == EXIT_EQUIVALENT, output
    assert report["weights"]["rule"] in RULES and len(report["steps"]) == STEPS
    if report["weights"]["max_abs_diff"] > 1e-4:  # the tolerance alone would have cried wolf
        assert report["weights"]["rule"] == "optimizer step bound"
        assert "attn.in_proj_bias" in report["weights"]["rule_detail"]


@needs_torch
@pytest.mark.e2e
def test_attention_trained_with_adam_in_float64_agrees_to_round_off(tmp_path: Path):
    code, output, report = _verify(tmp_path, ATTENTION, "--steps", STEPS, "--dtype", "float64")
    print(_figures("attention + Adam, --dtype float64", report))
    assert code == EXIT_EQUIVALENT, output
    assert report["weights"]["max_abs_diff"] < 1e-9 and report["weights"]["rule"] == "tolerance"
    assert report["max_loss_diff"] < 1e-12
    assert not [n for n in report["notes"] if n.startswith("--dtype float64")]  # everything ran in float64


@needs_torch
@pytest.mark.e2e
@pytest.mark.parametrize("dtype", ["native", "float64"])
def test_the_retrofit_with_its_inputs_shifted_diverges_naming_the_parameter(tmp_path: Path, dtype: str):
    from fsdp2_retrofit.verify import retrofit_in_memory

    code = retrofit_in_memory(ATTENTION, tmp_path / "retrofit").read_text()
    shift = "inputs.to(device) + args.shift"
    assert code.count(shift) == 1
    twin = tmp_path / "shifted.py"
    twin.write_text(code.replace(shift, shift + " + 0.01"))
    code, output, report = _verify(tmp_path, ATTENTION, "--retrofitted", twin, "--steps", STEPS, "--dtype", dtype)
    print(_figures(f"attention + Adam, inputs shifted by 0.01 in the retrofit ({dtype})", report))
    assert code == EXIT_DIVERGED, output
    name = report["weights"]["worst_name"]
    assert name and name.split(".")[0] in ("embed", "blocks", "head")
    assert f"'{name}'" in report["summary"] and f"'{name}'" in " ".join(output.split())


NO_FLOAT64 = """\
import torch
import torch.nn as nn

model = nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.ones(4, 2, dtype=torch.float32)  # made in float32 explicitly, met outside a module's forward
for _ in range(2):
    loss = (x @ model.weight.t()).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@needs_torch
@pytest.mark.e2e
def test_a_script_that_cannot_run_in_float64_is_said_to(tmp_path: Path):
    script = tmp_path / "explicit_float32.py"
    script.write_text(NO_FLOAT64)
    code, output, report = _verify(tmp_path, script, "--retrofitted", script, "--dtype", "float64")
    assert code == 2, output
    assert "with --dtype float64: the script may not run in float64" in report["error"]
    assert "run without --dtype float64" in report["error"]


@needs_torch
def test_parameters_are_named_by_the_root_that_holds_the_most_of_them():
    import torch.nn as nn

    spec = importlib.util.spec_from_file_location("_verify_site", COMPARE_SCRIPT.parent / "sitecustomize.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)  # without FSDP2_RETROFIT_VERIFY_DIR it installs nothing

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
            self.head = nn.Linear(2, 1)

    net = Net()
    holder = nn.Module()
    holder._orig_mod = net  # as torch.compile's wrapper holds the model
    loose = nn.Linear(3, 3)  # a second root with fewer parameters
    names = site._param_names([net.blocks[1].bias, net.head.weight, loose.weight])
    assert names == ["blocks.1.bias", "head.weight", "weight"]


@needs_torch
@pytest.mark.e2e
def test_a_model_under_bfloat16_autocast_is_equivalent_at_the_defaults(tmp_path: Path):
    """Measured (10 steps, CPU): losses 9.8e-4 apart at ~3 (bfloat16's spacing there: 0.0156), the
    parameters' gradient norms up to 0.67% apart, final weights up to 1.2e-2 (the key biases; AdamW
    lr 3e-3). Before the compute dtype was recorded: "diverged at step 5: loss 2.84463 vs 2.84506"."""
    script = REPO / "fixtures" / "rewrite" / "mixed_precision_autocast" / "input.py"
    code, output, report = _verify(tmp_path, script, "--steps", 10, "--", "--batch-size", 16)
    print(_figures("TinyLM under bf16 autocast", report))
    assert code == EXIT_EQUIVALENT, output

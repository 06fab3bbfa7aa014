"""Compare what two runs left behind; print JSON.

Run by `fsdp2-retrofit verify` in a child process (the tool itself never
imports torch), two ways:

``python _fsdp2_verify_compare.py SINGLE.pt DIST.pt [BAND_JSON]``
    the weight lists the verify instrumentation wrote (tensors in
    ``param_groups`` order). Prints ``{"count": [n_single, n_dist], "tensors":
    [{"index", "shape_single", "shape_dist", "dtype", "max_abs_diff"}...]}``;
    ``max_abs_diff`` is null where the shapes differ. With BAND_JSON
    (``{"tolerance": T, "ulps": U}``), each row also says how many elements lie
    outside the band ``max(T, U * ulp)`` (``over``; ulp: the spacing of the
    tensor's dtype at the larger magnitude of the two), the first of them in
    row-major order (``first_over``: index, both values, the difference, the
    allowed difference), the largest difference in ulps (``max_ulps``) and
    where the largest difference is (``worst``).

``python _fsdp2_verify_compare.py --saved SPEC_JSON``
    the files the scripts saved themselves (a ``torch.save`` file or a DCP
    directory each); SPEC_JSON is ``{"single", "dist", "keys", "single_prefix"}``.
    ``keys`` picks the state dicts out of the saved objects (see ``select``);
    ``single_prefix`` is dropped from the single run's names. Prints the same
    shape with a ``name`` per tensor, plus ``only_single`` and ``only_dist``
    (names one side lacks), or ``{"error": ...}`` when a file does not hold
    what ``keys`` asks for.
"""
import json
import os
import sys
import tempfile

import torch


def main(single_path, dist_path, band=None):
    # written moments ago by the verify run itself
    a = torch.load(single_path, map_location="cpu", weights_only=True)
    b = torch.load(dist_path, map_location="cpu", weights_only=True)
    rows = []
    for i, (x, y) in enumerate(zip(a, b)):
        rows.append(_row(i, x, y, band=band))
    json.dump({"count": [len(a), len(b)], "tensors": rows}, sys.stdout)


def _row(i, x, y, name=None, band=None):
    row = {"index": i, "shape_single": list(x.shape), "shape_dist": list(y.shape), "max_abs_diff": None,
           "dtype": str(x.dtype).replace("torch.", "")}
    if name is not None:
        row["name"] = name
    if x.shape == y.shape:
        row["max_abs_diff"] = float((x.double() - y.double()).abs().max().item()) if x.numel() else 0.0
        if band is not None:
            row.update(_band(x, y, band["tolerance"], band["ulps"]))
    return row


def ulp(magnitude, dtype):
    """The spacing of ``dtype``'s values at each ``magnitude`` (a float64 tensor)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(magnitude.clamp(min=info.tiny))
    return torch.ldexp(torch.full_like(magnitude, info.eps), exponent - 1)


def _band(x, y, tolerance, ulps):
    """The elements outside ``max(tolerance, ulps * ulp)``: how many, the first, the worst."""
    if not x.numel():
        return {"over": 0, "max_ulps": 0.0}
    a, b = x.detach().double().flatten(), y.detach().double().flatten()
    diff = (a - b).abs()
    floating = x.is_floating_point() and y.is_floating_point()
    spacing = ulp(torch.maximum(a.abs(), b.abs()), x.dtype) if floating else torch.ones_like(diff)
    allowed = (ulps * spacing).clamp(min=tolerance) if floating else torch.full_like(diff, tolerance)
    outside = ~(diff <= allowed)  # a NaN is outside
    out = {"over": int(outside.sum().item()), "max_ulps": float((diff / spacing).max().item())}

    def element(k):
        index = [int(v) for v in torch.unravel_index(torch.tensor(k), tuple(x.shape))] if x.dim() else []
        return {"index": index, "single": float(a[k]), "dist": float(b[k]), "diff": float(diff[k]),
                "allowed": float(allowed[k])}

    if out["over"]:
        out["first_over"] = element(int(outside.nonzero()[0, 0]))
    out["worst"] = element(int(torch.nan_to_num(diff, nan=float("inf")).argmax()))
    return out


def load_saved(path):
    """What a run saved: a ``torch.save`` file or a DCP checkpoint directory."""
    if os.path.isdir(path):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            converted = os.path.join(tmp, "converted.pt")
            dcp_to_torch_save(path, converted)
            # written moments ago by the run this compares: safe to unpickle
            return torch.load(converted, map_location="cpu", weights_only=False)
    return torch.load(path, map_location="cpu", weights_only=False)


def select(obj, keys):
    """The state dicts in a saved object, as one flat ``name -> tensor`` dict.

    ``keys`` empty: ``obj`` is itself a state dict. One key: ``obj[key]`` is the
    state dict. Several keys: each state dict's names are prefixed ``key.``
    (``["model", "ema"]`` compares the EMA copy too). Raises KeyError or
    TypeError when the object does not hold that.
    """
    if not keys:
        parts = {"": obj}
    else:
        if not isinstance(obj, dict):
            raise TypeError(f"expected a dict with keys {list(keys)}, got {type(obj).__name__}")
        missing = [k for k in keys if k not in obj]
        if missing:
            raise KeyError(f"saved object has no key(s) {missing}; it has {sorted(map(str, obj))}")
        parts = {k: obj[k] for k in keys}
    flat = {}
    for prefix, state in parts.items():
        if not isinstance(state, dict):
            raise TypeError(f"{prefix or 'saved object'} is a {type(state).__name__}, not a state dict")
        for name, value in state.items():
            full = f"{prefix}.{name}" if len(parts) > 1 else name
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{full} is a {type(value).__name__}, not a tensor")
            if type(value).__name__ == "DTensor":  # a save of the sharded model: each rank's shard
                raise TypeError(f"{full} is a DTensor, not a full tensor")
            flat[full] = value
    return flat


def compare_saved(spec):
    try:
        single = select(load_saved(spec["single"]), spec.get("keys", []))
        dist = select(load_saved(spec["dist"]), spec.get("keys", []))
    except (KeyError, TypeError) as exc:
        return {"error": str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)}
    prefix = spec.get("single_prefix", "")
    if prefix:
        unprefixed = [k for k in single if not k.startswith(prefix)]
        if unprefixed:
            return {"error": f"single_prefix {prefix!r}: the single run's {unprefixed[0]!r} does not start with it"}
        single = {k[len(prefix):]: v for k, v in single.items()}
    names = sorted(set(single) & set(dist))
    band = spec.get("band")
    rows = [_row(i, single[n], dist[n], name=n, band=band) for i, n in enumerate(names)]
    return {"count": [len(single), len(dist)], "tensors": rows,
            "only_single": sorted(set(single) - set(dist)), "only_dist": sorted(set(dist) - set(single))}


if __name__ == "__main__":
    if sys.argv[1] == "--saved":
        json.dump(compare_saved(json.loads(sys.argv[2])), sys.stdout)
    else:
        main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)

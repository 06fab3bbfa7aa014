"""Compare two weight lists written by the verify instrumentation; print JSON.

Run by `fsdp2-retrofit verify` in a child process (the tool itself never
imports torch): ``python _fsdp2_verify_compare.py SINGLE.pt DIST.pt``.
Prints ``{"count": [n_single, n_dist], "tensors": [{"index", "shape_single",
"shape_dist", "max_abs_diff"}...]}``; ``max_abs_diff`` is null where the shapes
differ.
"""
import json
import sys

import torch


def main(single_path, dist_path):
    # written moments ago by the verify run itself
    a = torch.load(single_path, map_location="cpu", weights_only=True)
    b = torch.load(dist_path, map_location="cpu", weights_only=True)
    rows = []
    for i, (x, y) in enumerate(zip(a, b)):
        row = {"index": i, "shape_single": list(x.shape), "shape_dist": list(y.shape), "max_abs_diff": None}
        if x.shape == y.shape:
            row["max_abs_diff"] = float((x.double() - y.double()).abs().max().item()) if x.numel() else 0.0
        rows.append(row)
    json.dump({"count": [len(a), len(b)], "tensors": rows}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

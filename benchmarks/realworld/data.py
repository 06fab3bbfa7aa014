"""Synthetic inputs for the real-world corpus, in the on-disk formats the scripts read.

Run by the runner with the interpreter that runs the scripts (numpy and PIL
come from there): ``python data.py SPEC.json``, where SPEC.json is a list of
``{"kind": ..., "path": ABSOLUTE TARGET, ...options}``. Every kind is a
function registered with ``@kind(name)``; the data is random but fixed (a
seeded generator), tiny, and never downloaded.
"""
import json
import os
import pickle
import struct
import sys

import numpy as np

KINDS = {}


def kind(name):
    def register(fn):
        KINDS[name] = fn
        return fn
    return register


def _rng(spec):
    return np.random.default_rng(int(spec.get("seed", 0)))


@kind("mnist")
def mnist(path, spec):
    """torchvision MNIST/FashionMNIST raw idx files (uncompressed: torchvision reads them as they are)."""
    rng = _rng(spec)
    raw = os.path.join(path, spec.get("folder", "MNIST"), "raw")
    os.makedirs(raw, exist_ok=True)
    for prefix, n in (("train", int(spec.get("n", 256))), ("t10k", int(spec.get("n_test", 64)))):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        with open(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), "wb") as f:
            f.write(struct.pack(">IIII", 0x00000803, n, 28, 28))
            f.write(images.tobytes())
        with open(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
            f.write(struct.pack(">II", 0x00000801, n))
            f.write(labels.tobytes())


@kind("mnist-gz")
def mnist_gz(path, spec):
    """The four gzipped MNIST idx files as yann.lecun.com served them, ``path/<name>.gz``
    (scripts that unpack them themselves, some with the full sizes 60000/10000 written into
    their reshapes: ``n`` and ``n_test`` default to those). Pixels are random but compress
    (few levels), so the files stay small."""
    import gzip

    rng = _rng(spec)
    os.makedirs(path, exist_ok=True)
    for prefix, n in (("train", int(spec.get("n", 60000))), ("t10k", int(spec.get("n_test", 10000)))):
        images = (rng.integers(0, 4, size=(n, 28, 28), dtype=np.uint8) * 85).astype(np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        with gzip.open(os.path.join(path, f"{prefix}-images-idx3-ubyte.gz"), "wb", compresslevel=1) as f:
            f.write(struct.pack(">IIII", 0x00000803, n, 28, 28))
            f.write(images.tobytes())
        with gzip.open(os.path.join(path, f"{prefix}-labels-idx1-ubyte.gz"), "wb", compresslevel=1) as f:
            f.write(struct.pack(">II", 0x00000801, n))
            f.write(labels.tobytes())


@kind("cifar10")
def cifar10(path, spec):
    """torchvision CIFAR10 python pickles: 5 training batches, a test batch, the meta file."""
    rng = _rng(spec)
    base = os.path.join(path, "cifar-10-batches-py")
    os.makedirs(base, exist_ok=True)
    n, n_test = int(spec.get("n", 260)), int(spec.get("n_test", 64))
    if n % 5:
        raise SystemExit("cifar10: n must divide by 5 (five training batches)")
    names = [(f"data_batch_{i}", n // 5) for i in range(1, 6)] + [("test_batch", n_test)]
    for name, count in names:
        batch = {"data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, size=(count,)).tolist(), "batch_label": name}
        with open(os.path.join(base, name), "wb") as f:
            pickle.dump(batch, f)
    with open(os.path.join(base, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                                     "ship", "truck"]}, f)


@kind("cifar100")
def cifar100(path, spec):
    """torchvision CIFAR100 python pickles: ``cifar-100-python/{train,test,meta}`` (fine and coarse labels)."""
    rng = _rng(spec)
    base = os.path.join(path, "cifar-100-python")
    os.makedirs(base, exist_ok=True)
    for name, count in (("train", int(spec.get("n", 256))), ("test", int(spec.get("n_test", 64)))):
        batch = {"data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
                 "fine_labels": rng.integers(0, 100, size=(count,)).tolist(),
                 "coarse_labels": rng.integers(0, 20, size=(count,)).tolist(), "batch_label": name}
        with open(os.path.join(base, name), "wb") as f:
            pickle.dump(batch, f)
    with open(os.path.join(base, "meta"), "wb") as f:
        pickle.dump({"fine_label_names": [f"class{i}" for i in range(100)],
                     "coarse_label_names": [f"super{i}" for i in range(20)]}, f)


@kind("images")
def images(path, spec):
    """Random images: ``path/<subdir>/<i>.<ext>``, or with ``classes`` an ImageFolder layout."""
    from PIL import Image

    rng = _rng(spec)
    n = int(spec.get("n", 32))
    width, height = spec.get("size", [64, 64])
    ext = spec.get("ext", "jpg")
    mode = spec.get("mode", "RGB")
    classes = int(spec.get("classes", 0))
    channels = {"RGB": 3, "L": 1}[mode]
    for sub in spec.get("subdirs", [""]):
        folders = [os.path.join(path, sub, f"class{j}") for j in range(classes)] if classes else [os.path.join(path, sub)]
        for folder in folders:
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
                image = Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels, mode)
                image.save(os.path.join(folder, f"{i:05d}.{ext}"))


@kind("isic")
def isic(path, spec):
    """ISIC-2018-style segmentation pairs: ``path/<split>/ISIC_<i>.jpg`` (RGB) and
    ``path/<split>_GT/ISIC_<i>_segmentation.png`` (a binary mask, mode L) for each split."""
    from PIL import Image

    rng = _rng(spec)
    n = int(spec.get("n", 8))
    width, height = spec.get("size", [64, 48])
    for split in spec.get("splits", ["train", "valid", "test"]):
        os.makedirs(os.path.join(path, split), exist_ok=True)
        os.makedirs(os.path.join(path, f"{split}_GT"), exist_ok=True)
        for i in range(n):
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels, "RGB").save(os.path.join(path, split, f"ISIC_{i:07d}.jpg"))
            mask = (rng.random((height, width)) > 0.5).astype(np.uint8) * 255
            Image.fromarray(mask, "L").save(os.path.join(path, f"{split}_GT", f"ISIC_{i:07d}_segmentation.png"))


def _words(rng, vocab):
    return [f"w{i}" for i in range(vocab)]


@kind("text")
def text(path, spec):
    """A text file of random words, ``line`` words a line, then the line ``extra`` (characters a
    script's sampling prompt needs in the vocabulary)."""
    rng = _rng(spec)
    words = _words(rng, int(spec.get("vocab", 60)))
    total, per_line = int(spec.get("words", 3000)), int(spec.get("line", 12))
    picks = rng.integers(0, len(words), size=(total,))
    lines = [" ".join(words[int(j)] for j in picks[i:i + per_line]) for i in range(0, total, per_line)]
    lines += [spec["extra"]] if spec.get("extra") else []
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


@kind("llmc-tokens")
def llmc_tokens(path, spec):
    """llm.c's token shard: a header of 256 int32 (magic 20240520, version 1, token count), then uint16 tokens."""
    rng = _rng(spec)
    count, vocab = int(spec.get("tokens", 4096)), int(spec.get("vocab", 50257))
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, int(spec.get("version", 1)), count
    dtype = np.uint32 if int(spec.get("version", 1)) == 7 else np.uint16
    tokens = rng.integers(0, vocab, size=(count,)).astype(dtype)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())


@kind("python")
def python_code(path, spec):
    """Run the manifest's ``code`` with ``path`` (the target) and ``src`` (the extracted repository) defined,
    the extracted script's directory (``script_dir``, relative to src) first on sys.path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    sys.path.insert(0, os.path.join(spec["src"], spec.get("script_dir", "")))
    exec(compile(spec["code"], "<manifest data code>", "exec"), {"path": path, "src": spec["src"], "__name__": "data"})


def main(spec_path):
    with open(spec_path, encoding="utf-8") as f:
        entries = json.load(f)
    for entry in entries:
        fn = KINDS.get(entry["kind"])
        if fn is None:
            raise SystemExit(f"unknown data kind {entry['kind']!r} (known: {', '.join(sorted(KINDS))})")
        fn(entry["path"], entry)


if __name__ == "__main__":
    main(sys.argv[1])

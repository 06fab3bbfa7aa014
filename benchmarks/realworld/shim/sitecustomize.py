"""The corpus harness's shim, run in every process of a corpus run (after verify's instrumentation).

It does three things, each switched by the environment, and nothing else:

* REALWORLD_SEED=N: ``torch.manual_seed(N + RANK)`` at start-up (RANK is 0 in
  the single run). An unseeded script then builds the single run's initial
  weights on rank 0 and other weights on the other ranks, as it would for a
  user (each process draws its own seed): a retrofit that does not make every
  rank start from rank 0's weights shows up as a divergence instead of being
  hidden by the harness.
* REALWORLD_SKIP_INTEGRITY=1: torchvision's CIFAR datasets skip their md5
  integrity check (synthetic batch files cannot match the real checksums), so
  ``download=True`` finds the files present and downloads nothing. The
  loading code (unpickling the batches) is torchvision's own, unchanged. The
  patch is applied when ``torchvision.datasets.cifar`` is first imported.
* REALWORLD_DETERMINISTIC=1 (a `trains` row's deterministic twin): the random
  draws are made the same in the single run and on the ranks together, so the
  twin can reach parity where the row itself only trains. Every process seeds
  torch, numpy and random with REALWORLD_SEED alone (no rank offset); dropout is
  off (the functional dropouts return their input, attention's dropout_p is 0);
  a dataset item is fetched under a seed made from its index (augmentation is a
  function of the sample, whichever rank reads it; the global streams are put
  back after it); and under torchrun, a draw whose first dimension is this
  rank's batch (the first dimension of the last DataLoader batch; an in-place
  ``x.normal_()`` / ``x.uniform_()`` too, as Normal.rsample makes; ``torch.bernoulli(p)``
  is drawn as uniforms below p in every run for this) is drawn for
  the whole global batch and this rank keeps rows rank, rank + world_size, ...
  -- the rows of the single run's draw that belong to this rank's samples (verify
  hands the single run the ranks' samples interleaved that way). A draw that
  is not batch-shaped is made as written, on every rank alike. BatchNorm in
  training mode normalises with the global batch's statistics (all-reduced, as
  the retrofit's SyncBatchNorm does on GPUs; the single run uses the same sums).
"""
import os
import sys


def _seed():
    value = os.environ.get("REALWORLD_SEED")
    if value:
        import torch

        torch.manual_seed(int(value) + int(os.environ.get("RANK", "0")))


def _patch_cifar(module):
    # the module's own check_integrity (by md5) becomes "the file exists"; used by
    # CIFAR10._check_integrity (download=True) and _load_meta
    module.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)


class _AfterImport:
    """A meta-path finder that patches a module right after its own loader ran."""

    target = "torchvision.datasets.cifar"

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch_cifar(module)

        loader.exec_module = exec_module
        return spec


def _deterministic():
    import random

    import torch
    import torch.nn.functional as F

    try:
        import numpy as np
    except ImportError:
        np = None
    seed = int(os.environ.get("REALWORLD_SEED") or 0)
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    last = {"batch": None}

    # -- dropout off -------------------------------------------------------------
    def keep(input, *args, **kwargs):
        return input

    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
        if hasattr(F, name):
            setattr(F, name, keep)
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    if sdpa is not None:
        def attention(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
            return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

        F.scaled_dot_product_attention = attention

    # -- the batch size, and each item under its own seed ---------------------------
    from torch.utils.data._utils import fetch
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    original_next = _BaseDataLoaderIter.__next__

    def recording_next(self):
        batch = original_next(self)
        first = batch
        while isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, dict) and first:
            first = next(iter(first.values()))
        shape = getattr(first, "shape", None)
        if shape:
            last["batch"] = int(shape[0])
        return batch

    _BaseDataLoaderIter.__next__ = recording_next

    original_fetch = fetch._MapDatasetFetcher.fetch

    def seeded(dataset, index):
        states = (torch.get_rng_state(), random.getstate(), np.random.get_state() if np is not None else None)
        item_seed = (seed * 1_000_003 + int(index)) % 2**31
        torch.manual_seed(item_seed)
        random.seed(item_seed)
        if np is not None:
            np.random.seed(item_seed)
        try:
            return dataset[index]
        finally:
            torch.set_rng_state(states[0])
            random.setstate(states[1])
            if np is not None:
                np.random.set_state(states[2])

    def fetch_by_index(self, possibly_batched_index):
        try:
            if self.auto_collation:
                return self.collate_fn([seeded(self.dataset, i) for i in possibly_batched_index])
            return self.collate_fn(seeded(self.dataset, possibly_batched_index))
        except TypeError:  # an index that is not an integer (a dict's key, a tuple)
            return original_fetch(self, possibly_batched_index)

    fetch._MapDatasetFetcher.fetch = fetch_by_index

    _synchronised_batch_norm(torch, F, world, last)

    # -- torch.bernoulli(p) on a batch-shaped p (classifier-free guidance's context drop): drawn as
    # uniforms below p in every run (the single run too), so the ranks can take the global batch's rows
    original_bernoulli = torch.bernoulli

    def bernoulli(input, *args, **kwargs):
        if isinstance(input, torch.Tensor) and input.is_floating_point() and not args and not kwargs \
                and input.shape and last["batch"] is not None and int(input.shape[0]) == last["batch"]:
            wide = (input.shape[0] * world, *input.shape[1:])
            uniform = torch.rand(wide, dtype=input.dtype, device=input.device)[rank::world]
            return (uniform < input).to(input.dtype)
        return original_bernoulli(input, *args, **kwargs)

    torch.bernoulli = bernoulli
    if world <= 1:
        return

    # -- batch-shaped draws: the global batch's, this rank's rows ------------------------
    def batch_rows(shape):
        return bool(shape) and last["batch"] is not None and int(shape[0]) == last["batch"]

    def mine(value):
        return value[rank::world].copy() if np is not None and isinstance(value, np.ndarray) else \
            value[rank::world].clone()

    def sized(fn, size_at, keyword="size"):
        """fn draws `size` (an int tuple at args[size_at] or keyword)."""
        def draw(*args, **kwargs):
            size = kwargs.get(keyword) if keyword in kwargs else (args[size_at] if len(args) > size_at else None)
            if isinstance(size, int):
                size = (size,)
            if isinstance(size, (tuple, list, torch.Size)) and size and all(isinstance(d, int) for d in size) \
                    and batch_rows(size):
                wide = (size[0] * world, *size[1:])
                if keyword in kwargs:
                    kwargs[keyword] = wide
                else:
                    args = args[:size_at] + (wide,) + args[size_at + 1:]
                return mine(fn(*args, **kwargs))
            return fn(*args, **kwargs)
        return draw

    def varargs(fn):
        """torch.randn(2, 3) or torch.randn((2, 3)): the size is the leading positional ints."""
        def draw(*args, **kwargs):
            if args and isinstance(args[0], (tuple, list, torch.Size)):
                size, rest = tuple(args[0]), args[1:]
            else:
                count = 0
                while count < len(args) and isinstance(args[count], int):
                    count += 1
                size, rest = tuple(args[:count]), args[count:]
            if "size" in kwargs:
                size = tuple(kwargs.pop("size"))
            if size and batch_rows(size):
                return mine(fn((size[0] * world, *size[1:]), *rest, **kwargs))
            return fn(size, *rest, **kwargs) if size else fn(*args, **kwargs)
        return draw

    def like(fn, maker):
        def draw(input, *args, **kwargs):
            if isinstance(input, torch.Tensor) and batch_rows(tuple(input.shape)):
                wide = (input.shape[0] * world, *input.shape[1:])
                kwargs.setdefault("dtype", input.dtype)
                kwargs.setdefault("device", input.device)
                return mine(maker(wide, *args, **kwargs))
            return fn(input, *args, **kwargs)
        return draw

    torch.randn = varargs(torch.randn)
    torch.rand = varargs(torch.rand)
    torch.randint = _randint(torch, batch_rows, mine, world)
    torch.randn_like = like(torch.randn_like, lambda size, **kw: torch.randn(size, **kw))
    torch.rand_like = like(torch.rand_like, lambda size, **kw: torch.rand(size, **kw))

    def in_place(method):
        """x.normal_() / x.uniform_() on a batch-shaped tensor (a VAE's eps, Normal.rsample's
        standard normal): the global batch's draw, this rank's rows copied in."""
        def draw(self, *args, **kwargs):
            if batch_rows(tuple(self.shape)) and not self.requires_grad:
                wide = self.new_empty((self.shape[0] * world, *self.shape[1:]))
                method(wide, *args, **kwargs)
                with torch.no_grad():
                    self.copy_(wide[rank::world])
                return self
            return method(self, *args, **kwargs)
        return draw

    torch.Tensor.normal_ = in_place(torch.Tensor.normal_)
    torch.Tensor.uniform_ = in_place(torch.Tensor.uniform_)
    if np is not None:
        np.random.normal = sized(np.random.normal, 2)
        np.random.uniform = sized(np.random.uniform, 2)
        np.random.randint = sized(np.random.randint, 2)
        np.random.random = sized(np.random.random, 0)
        np.random.standard_normal = sized(np.random.standard_normal, 0)

        def dims(fn):  # np.random.randn(4, 3), np.random.rand(4, 3)
            def draw(*args):
                if args and all(isinstance(d, int) for d in args) and batch_rows(args):
                    return mine(fn(args[0] * world, *args[1:]))
                return fn(*args)
            return draw

        np.random.randn = dims(np.random.randn)
        np.random.rand = dims(np.random.rand)


def _synchronised_batch_norm(torch, F, world, last):
    """BatchNorm in training mode normalises with the statistics of the global batch, as the
    retrofit's SyncBatchNorm does on GPUs (SyncBatchNorm runs on GPUs only: on CPU each rank
    would use its own half of the batch). The sums are all-reduced with autograd (the
    gradient of each rank's loss reaches every rank's inputs, as SyncBatchNorm's backward
    does); the single run uses the same formula, so both compute alike."""
    original = F.batch_norm

    def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                   eps=1e-5):
        if not training or input.dim() < 2:
            return original(input, running_mean, running_var, weight, bias, training, momentum, eps)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        count = torch.tensor([input.numel() / channels], dtype=input.dtype, device=input.device)
        stats = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        if world > 1 and last["batch"] is not None and input.shape[0] == last["batch"]:
            import torch.distributed as dist
            from torch.distributed.nn.functional import all_reduce

            if dist.is_initialized():
                stats = all_reduce(stats)
        n = stats[-1]
        mean = stats[:channels] / n
        var = stats[channels:2 * channels] / n - mean * mean
        shape = (1, channels) + (1,) * (input.dim() - 2)
        out = (input - mean.view(shape)) / torch.sqrt(var.view(shape) + eps)
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                m = 0.1 if momentum is None else momentum
                running_mean.mul_(1 - m).add_(mean.detach() * m)
                running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)) * m)
        return out

    F.batch_norm = batch_norm


def _randint(torch, batch_rows, mine, world):
    """torch.randint(high, size) or torch.randint(low, high, size): the size is the first tuple."""
    original = torch.randint

    def draw(*args, **kwargs):
        at = next((i for i, a in enumerate(args) if isinstance(a, (tuple, list, torch.Size))), None)
        size = tuple(kwargs["size"]) if "size" in kwargs else (tuple(args[at]) if at is not None else None)
        if size and batch_rows(size):
            wide = (size[0] * world, *size[1:])
            if "size" in kwargs:
                kwargs["size"] = wide
            else:
                args = args[:at] + (wide,) + args[at + 1:]
            return mine(original(*args, **kwargs))
        return original(*args, **kwargs)
    return draw


if os.environ.get("REALWORLD_SKIP_INTEGRITY") == "1":
    sys.meta_path.insert(0, _AfterImport())
if os.environ.get("REALWORLD_DETERMINISTIC") == "1":
    _deterministic()
else:
    _seed()

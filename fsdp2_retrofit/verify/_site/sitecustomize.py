"""Instrumentation for `fsdp2-retrofit verify`, loaded by the scripts it runs.

`verify` puts this directory first on the child's PYTHONPATH, so Python imports
this module at start-up, before the user's script. Without
FSDP2_RETROFIT_VERIFY_DIR or FSDP2_RETROFIT_VERIFY_SAMPLER in the environment
it does nothing and imports nothing (then it only hands over to a sitecustomize it
shadows). With it:

* ``torch.Tensor.backward`` is wrapped: the value of each scalar tensor that
  ``backward()`` is called on (the loss of a micro-step) is added up until the
  next optimizer step. One step's loss is the SUM over its micro-steps: with
  gradient accumulation the single run and every rank run the same number of
  micro-steps, each on the matching slice of the global batch, so the mean
  over ranks of the per-rank sums equals the single run's sum. For the output
  of a loss scaler (``torch.amp.GradScaler.scale``) the loss it scaled is
  recorded: the scale is the scaler's, and an overflowing step's is inf.
* A global optimizer step pre-hook records the total gradient norm the
  optimizer is about to use (after any clipping). Sharded gradients are
  DTensors: each parameter's norm is taken as a DTensor and made whole with
  ``.full_tensor()`` on every rank (the hook runs on every rank, so the
  collectives line up, and HSDP meshes are reduced the right way).
* A global optimizer step post-hook counts steps of the first optimizer that
  steps ("the" optimizer; others are gathered at the end too). After K steps
  (FSDP2_RETROFIT_VERIFY_STEPS; 0: never, the script runs to its end) every rank gathers the final parameters in
  ``param_groups`` order (DTensor -> ``.full_tensor()``), rank 0 writes them
  with ``torch.save`` (under torchrun every other rank writes its own copy,
  ``weights_rank{r}.pt``, to check that the ranks agree), every rank writes its JSON record, and after a barrier
  all ranks leave with ``os._exit(0)`` (files flushed first).
* The step torch.distributed.checkpoint takes to create an empty optimizer's
  state (``_init_optim_state``: lr 0, zero gradients) is not counted.
* A script that ends before K steps is recorded when it calls
  ``destroy_process_group`` (all ranks still together: weights gathered) or
  at exit (weights gathered only while a process group is still up).
* Every step's end is timed (``step_seconds``: the wall time between one step's
  post-hook and the next's). With FSDP2_RETROFIT_VERIFY_TIMING=1 (benchmarks/gpu)
  the record is made for timing: CUDA is synchronized before each time is taken,
  and nothing is measured that costs a sync or a collective of its own (no
  gradient norm, no weights gathered at the start or the end).
* Each step records the samples it trained on: the first dimension of the last
  DataLoader batch drawn before each backward, summed over the step's backwards
  (verify compares the single run's with the ranks' sum: the global batch).
  Under torchrun, the epoch of every shuffled ``DistributedSampler`` pass is
  recorded in order (``sampler_epochs``).
* With FSDP2_RETROFIT_VERIFY_SAMPLER=1 (the single-process run), every
  ``RandomSampler`` yields the permutation ``DistributedSampler(shuffle=True,
  seed=0)`` draws at epoch e before it splits it between ranks, so batch k of
  the single run holds exactly the samples of batch k on all ranks together
  (the dataset length must divide by the number of ranks). e is the pass's
  number from 0, or with FSDP2_RETROFIT_VERIFY_EPOCHS ("1,2,3") the epochs the
  distributed run's samplers were at, pass by pass; a -1 there is a shuffled pass
  the distributed run left to a RandomSampler (a loader the retrofit did not
  split): the single run's pass at that place draws as the original does (its
  seed from the global generator, which keeps the two runs' streams in step).
* With FSDP2_RETROFIT_VERIFY_TO_END=1 the run records after K steps as usual
  and then goes on: the loaders a backward trained on end their passes (they
  yield nothing more; evaluation loaders still yield), so the script reaches
  what it does after training (final evaluation, generation, the last save)
  and its exit record says whether that ended cleanly. The sampler is
  installed on its own too, without FSDP2_RETROFIT_VERIFY_DIR (a reference run
  that should not be instrumented).

* Each parameter the optimizers train is named (``param_names``: its qualified
  name in the module that holds it, wrappers' parts such as DDP's ``module.``
  dropped) and described (``params``: its optimizer's class, the sum of the
  learning rates of the steps it took, its dtype); the primary optimizer's
  parameters' gradient norms are recorded per step (``param_grad_norms``), and
  the least precise dtype of the losses and gradients (``loss_dtype``,
  ``grad_dtype``): verify judges round-off by them.
* With FSDP2_RETROFIT_VERIFY_DTYPE=float64, the run is made in float64 where the
  script lets it: the default dtype is float64 (the parameters and the floating
  tensors it creates), ``Module.float()`` and ``Tensor.float()`` give float64,
  autocast is off, and a module's floating inputs, parameters and buffers are
  cast to float64 before its forward (not DTensors: a sharded parameter keeps
  the dtype it was sharded with).
* Each rank registers faulthandler on SIGUSR1 (``stack_{pid}.txt``, every
  thread) and writes its pid (``pid_rank{r}.json``) and after each step its count
  (``progress_rank{r}.json``): where verify's timeout is hit, it asks each rank
  where it is before it kills the run.

Self-contained on purpose: the child may run another interpreter than the
tool, so nothing here imports fsdp2_retrofit.
"""
import os
import sys

# seconds a rank that used a process group waits at exit (see at_exit); benchmarks/teardown.py
# measures the aborts with and without it (FSDP2_RETROFIT_VERIFY_EXIT_GRACE overrides it)
EXIT_GRACE_S = 0.2


def _chain_shadowed_sitecustomize():
    """Run the sitecustomize this one shadows (a distribution's or a venv's), if any."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.origin is None or os.path.dirname(os.path.abspath(spec.origin)) == here:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:  # as Python itself does for a failing sitecustomize: carry on
        pass


def _active():
    if not os.environ.get("FSDP2_RETROFIT_VERIFY_DIR"):
        return False
    # under torchrun only the workers record (the launcher has no LOCAL_RANK)
    if os.environ.get("FSDP2_RETROFIT_VERIFY_MODE") == "dist" and "LOCAL_RANK" not in os.environ:
        return False
    return True


def _install():
    """Wrap what a training run goes through and record it (the module's docstring says what)."""
    import atexit
    import resource  # noqa: F401  (_peak_memory's: where it is missing, as on Windows, nothing is wrapped)

    import torch

    run = _Run()
    _register_stack_dump(run.out_dir)
    if os.environ.get("FSDP2_RETROFIT_VERIFY_DTYPE") == "float64":
        _in_float64(torch)
    if not run.timing:
        _watch_compute_dtype(torch, run.state)
    _wrap_backward(torch, run.state)
    _wrap_grad_scaler(torch, run.state)
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _wrap_loaders(run.state)
    register_optimizer_step_pre_hook(run.pre_hook)  # global: every optimizer, every rank
    register_optimizer_step_post_hook(run.post_hook)
    _wrap_process_group(run)
    _wrap_exits(run.state)
    atexit.register(run.at_exit)


# -- what the wrappers and the hooks share ---------------------------------


def _dist():
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist
    except Exception:
        pass
    return None


def _rank():
    dist = _dist()
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _is_dtensor(t):
    try:
        from torch.distributed.tensor import DTensor
    except Exception:
        return False
    return isinstance(t, DTensor)


# -- this process's run: its settings and state, the step hooks, the record at the end


def _new_state():
    """What the wrappers and the step hooks add up, until the record is written."""
    import time

    return {
        "step": 0,
        "pending_loss": None,  # sum of this step's micro-step losses
        "pending_micro": 0,
        "losses": [],
        "grad_norms": [],
        "micro_steps": [],
        "step_ends": [],  # time.perf_counter() at the end of each step
        "pending_samples": 0,  # samples of the batches this step's backwards were computed on
        "last_batch": 0,  # the size of the last DataLoader batch drawn, until a backward uses it
        "last_loader": None,  # the batch sampler of the loader that drew it
        "training_loaders": set(),  # ids of the batch samplers of loaders a backward trained on
        "stopped": False,  # to_end: the steps are done, training loaders end their passes
        "samples": [],  # per step: the samples this process read for it
        "sampler_epochs": [],  # the epoch of each shuffled DistributedSampler pass, in order (-1: a RandomSampler's)
        "optimizers": [],  # every optimizer that stepped, first to step first
        "initial": [],  # their parameters before their first step (gathered)
        "seen": set(),  # ids of the parameters already in "initial"
        "primary": None,
        "done": False,
        "failed": None,
        "uncaught": None,  # an exception that ended the script (sys.excepthook saw it)
        "exit_status": None,  # what the script gave sys.exit, if it called it
        "grouped": False,  # this process started or ended a process group
        "lr_sums": {},  # id(optimizer) -> per param group, the sum of the learning rates of its steps
        "opt_steps": {},  # id(optimizer) -> the steps it took
        "param_grad_norms": [],  # per step: each primary-optimizer parameter's gradient norm
        "dtypes": {"loss": None, "grad": None, "compute": None},  # the least precise dtype seen
        "started": time.time(),
    }


class _Run:
    """This process's record: the settings from the environment, what the wrappers add up
    (`state`), the optimizer step hooks, and the record written at the end."""

    def __init__(self):
        self.out_dir = os.environ["FSDP2_RETROFIT_VERIFY_DIR"]
        self.max_steps = int(os.environ.get("FSDP2_RETROFIT_VERIFY_STEPS", "10"))
        self.timing = os.environ.get("FSDP2_RETROFIT_VERIFY_TIMING") == "1"
        # after max_steps: record, then let the script go on to its end (its training loaders
        # yield nothing more), so what it does after training runs too
        self.to_end = os.environ.get("FSDP2_RETROFIT_VERIFY_TO_END") == "1"
        self.main_pid = os.getpid()
        self.state = _new_state()

    def pre_hook(self, optimizer, args, kwargs):
        state = self.state
        if state["done"] or _state_init_step():
            return
        if state["primary"] is None:
            state["primary"] = optimizer
        if self.timing:  # the step is counted and timed (post_hook), nothing gathered or reduced here
            return
        _note_step_sizes(state, optimizer)
        if all(o is not optimizer for o in state["optimizers"]):
            state["optimizers"].append(optimizer)
            # the weights this optimizer starts from, before its first update, of the
            # parameters no earlier optimizer held (those may have been updated already):
            # a run whose ranks did not start from the single run's weights is caught
            # even where the steps cannot be compared (random draws differ)
            fresh = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in state["seen"]]
            state["seen"].update(id(p) for p in fresh)
            state["initial"].extend(_gather_params(fresh))
        if optimizer is state["primary"]:
            total, norms, dtype = _grad_norm(optimizer)
            state["grad_norms"].append(total)
            state["param_grad_norms"].append(norms if len(norms) <= MAX_NAMED_PARAMS else [])
            state["dtypes"]["grad"] = _least_precise(state["dtypes"]["grad"], dtype)

    def post_hook(self, optimizer, args, kwargs):
        import time

        import torch

        state = self.state
        if state["done"] or optimizer is not state["primary"] or _state_init_step():
            return
        state["step"] += 1
        if self.timing and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        state["step_ends"].append(time.perf_counter())
        state["losses"].append(state["pending_loss"])
        state["micro_steps"].append(state["pending_micro"])
        state["samples"].append(state["pending_samples"])
        state["pending_loss"], state["pending_micro"], state["pending_samples"] = None, 0, 0
        if not self.timing:
            _write_json(os.path.join(self.out_dir, f"progress_rank{_rank()}.json"), {"steps": state["step"]})
        if self.max_steps and state["step"] >= self.max_steps:
            self.finish("steps", gather=True)
            if self.to_end:
                state["stopped"] = True
                return
            dist = _dist()
            if dist is not None:
                dist.barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def finish(self, reason, gather):
        import torch

        state, out_dir = self.state, self.out_dir
        if state["done"]:
            return
        state["done"] = True
        rank = _rank()
        weights = None
        params, info = _params_trained(state)
        if not self.timing:
            try:
                for entry, name in zip(info, _param_names(params)):
                    entry["name"] = name
            except Exception:  # names are for the messages only
                pass
        state["params"] = info
        if gather and not self.timing:
            try:
                weights = _gather_params(params)
            except Exception as exc:  # e.g. the process group is gone
                state["failed"] = state["failed"] or f"could not gather the weights: {exc}"
        if weights is not None and (rank == 0 or os.environ.get("FSDP2_RETROFIT_VERIFY_MODE") == "dist"):
            # rank 0 writes the run's weights; under torchrun every other rank writes what it
            # gathered too, so verify can check that the ranks ended with the same model
            name = "weights.pt" if rank == 0 else f"weights_rank{rank}.pt"
            tmp = os.path.join(out_dir, name + ".tmp")
            torch.save(weights, tmp)
            os.replace(tmp, os.path.join(out_dir, name))
        if rank == 0 and state["initial"]:
            tmp = os.path.join(out_dir, "initial.pt.tmp")
            torch.save(state["initial"], tmp)
            os.replace(tmp, os.path.join(out_dir, "initial.pt"))
        _write_record(state, out_dir, rank, reason, weights is not None)

    def at_exit(self):
        if os.getpid() != self.main_pid:  # a forked DataLoader worker
            return
        import json
        import multiprocessing
        import time

        if multiprocessing.parent_process() is not None:  # a spawned one
            return
        state = self.state
        # weights need every rank; a single process or a live group can gather them
        self.finish("exit", gather=_dist() is not None or "LOCAL_RANK" not in os.environ)
        # The script's own code has ended: say how, for a rank that gloo aborts from here on.
        status = state["exit_status"]
        clean = state["uncaught"] is None and status in (None, 0)
        exited = os.path.join(self.out_dir, f"exit_rank{_rank()}.json")
        with open(exited + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"clean": clean, "uncaught": state["uncaught"], "status": repr(status)}, f)
        os.replace(exited + ".tmp", exited)
        grace = float(os.environ.get("FSDP2_RETROFIT_VERIFY_EXIT_GRACE", EXIT_GRACE_S))
        if grace > 0 and (state["grouped"] or _dist() is not None):
            # A gloo worker thread may still hold the last collective's work, whose tensors it
            # releases under the GIL. Once finalization has begun, taking the GIL ends that
            # thread in the middle of a destructor: std::terminate, SIGABRT, after the script
            # finished. A short sleep (GIL released) lets it release them first.
            time.sleep(grace)


# -- the loss of each micro-step ------------------------------------------


def _wrap_backward(torch, state):
    original_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        try:
            if self.numel() == 1:
                scaled = state.pop("scaled", None)
                # a loss scaler's output: record the loss it scaled (the scale is not the model's)
                value = scaled[1] if scaled is not None and scaled[0] is self else self.detach()
                if _is_dtensor(value):
                    value = value.full_tensor()
                state["dtypes"]["loss"] = _least_precise(state["dtypes"]["loss"], value.dtype)
                value = float(value.float().item())
                state["pending_loss"] = value if state["pending_loss"] is None else state["pending_loss"] + value
                state["pending_micro"] += 1
                # the batch drawn last is the one this backward trains on (an evaluation pass
                # draws its batches before the next training batch is drawn); a second backward
                # on the same batch (a GAN's) adds nothing
                state["pending_samples"] += state["last_batch"]
                state["last_batch"] = 0
                if state["last_loader"] is not None:
                    state["training_loaders"].add(state["last_loader"])
        except Exception:
            pass
        return original_backward(self, *args, **kwargs)

    torch.Tensor.backward = backward


def _wrap_grad_scaler(torch, state):
    try:
        from torch.amp import GradScaler

        original_scale = GradScaler.scale

        def scale(self, outputs):
            result = original_scale(self, outputs)
            if isinstance(outputs, torch.Tensor) and result is not outputs and outputs.numel() == 1:
                state["scaled"] = (result, outputs.detach())
            return result

        GradScaler.scale = scale
    except Exception:  # an older torch without torch.amp.GradScaler
        pass


# -- the gradient norm and the step count ---------------------------------


def _grad_norm(optimizer):
    """(the total gradient norm, each parameter's (None: no gradient), the least precise gradient dtype)."""
    import torch

    total, norms, dtype = 0.0, [], None
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                norms.append(None)
                continue
            dtype = _least_precise(dtype, g.dtype)
            n = torch.linalg.vector_norm(g.detach().double() if g.dtype == torch.float64 else g.detach().float(), 2)
            if _is_dtensor(n):
                n = n.full_tensor()
            norms.append(float(n.item()))
            total += norms[-1] ** 2
    return total ** 0.5, norms, dtype


# parameters beyond this many are not named nor their gradient norms kept per step (a record stays small)
MAX_NAMED_PARAMS = 5000
_PRECISION = {"float64": 4, "float32": 3, "float16": 2, "bfloat16": 1}


def _least_precise(known, dtype):
    """The less precise of two dtype names (float8 and others count as least precise)."""
    name = str(dtype).replace("torch.", "") if dtype is not None else None
    if known is None or name is None:
        return known or name
    return name if _PRECISION.get(name, 0) < _PRECISION.get(known, 0) else known


def _note_step_sizes(state, optimizer):
    """Add this step's learning rate of each of the optimizer's param groups to their sums."""
    sums = state["lr_sums"].setdefault(id(optimizer), [])
    for i, group in enumerate(optimizer.param_groups):
        try:
            lr = abs(float(group.get("lr", 0.0)))
        except Exception:  # a learning rate that is not a number
            lr = float("nan")
        if i < len(sums):
            sums[i] += lr
        else:  # a group added since the last step
            sums.append(lr)
    state["opt_steps"][id(optimizer)] = state["opt_steps"].get(id(optimizer), 0) + 1


def _params_trained(state):
    """(every parameter of every optimizer in param_groups order, what verify needs to know of each)."""
    params, info = [], []
    for optimizer in state["optimizers"]:
        sums = state["lr_sums"].get(id(optimizer), [])
        for i, group in enumerate(optimizer.param_groups):
            hyper = {k: list(group[k]) if isinstance(group[k], tuple) else group[k] for k in ("betas", "alpha", "eps")
                     if isinstance(group.get(k), (int, float, tuple))}
            for p in group["params"]:
                params.append(p)
                info.append({"optimizer": type(optimizer).__name__, "lr_sum": sums[i] if i < len(sums) else 0.0,
                             "steps": state["opt_steps"].get(id(optimizer), 0),
                             "dtype": str(p.dtype).replace("torch.", ""), **hyper})
    return params, info


# the parts a wrapper adds to a parameter's name (DDP's leading `module.` is dropped on its own)
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _param_names(params):
    """Each parameter's qualified name in the module that holds it (None where no module does):
    read from the modules alive now, roots (modules no other holds) with the most parameters first."""
    import gc

    import torch

    if len(params) > MAX_NAMED_PARAMS:
        return [None] * len(params)
    # type(), not isinstance: an object's __class__ may be a property that warns (a deprecated alias)
    modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
    held = {id(child) for m in modules for child in m.children()}
    roots = [m for m in modules if id(m) not in held]
    roots.sort(key=lambda m: (-sum(1 for _ in m.parameters()), type(m).__name__))
    names = {}
    for root in roots:
        for name, p in root.named_parameters():
            if id(p) not in names:
                for part in _WRAPPER_PARTS:
                    name = name.replace(part, "")
                if type(root).__name__ == "DistributedDataParallel" and name.startswith("module."):
                    name = name[len("module."):]
                names[id(p)] = name
    return [names.get(id(p)) for p in params]


def _watch_compute_dtype(torch, state):
    """The least precise dtype a module's forward computed in: autocast's where it is on, else the
    dtype of the module's parameters (a loss in float32 computed from bfloat16 activations is only
    as precise as they are)."""

    def autocast_dtypes():
        for device in ("cpu", "cuda"):
            try:
                if torch.is_autocast_enabled(device):
                    yield torch.get_autocast_dtype(device)
            except Exception:  # an older torch: no device argument
                pass

    def note(module, args):
        if state["done"]:
            return
        try:
            dtype = state["dtypes"]["compute"]
            for autocast in autocast_dtypes():
                dtype = _least_precise(dtype, autocast)
            for p in module._parameters.values():
                if p is not None and p.is_floating_point():
                    dtype = _least_precise(dtype, p.dtype)
                    break
            state["dtypes"]["compute"] = dtype
        except Exception:
            pass

    torch.nn.modules.module.register_module_forward_pre_hook(note)


# -- float64: the run made in double precision where the script lets it ---


def _in_float64(torch):
    """Make the floating tensors the script creates, and what its modules meet, float64."""
    torch.set_default_dtype(torch.float64)
    lower = (torch.float32, torch.float16, torch.bfloat16)

    def cast(value):
        if isinstance(value, torch.Tensor) and value.dtype in lower and not _is_dtensor(value):
            return value.double()
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(cast(v) for v in value) if not hasattr(value, "_fields") else \
                type(value)(*(cast(v) for v in value))
        return value

    def before_forward(module, args):
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is not None and t.dtype in lower and not _is_dtensor(t):
                    t.data = t.data.double()
        return tuple(cast(a) for a in args)

    torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
    torch.nn.Module.float = torch.nn.Module.double
    try:  # autocast would compute the float64 model in bfloat16 or float16: it is turned off
        from torch.amp.autocast_mode import autocast

        original_init = autocast.__init__

        def autocast_init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self._enabled = False

        autocast.__init__ = autocast_init
    except Exception:
        pass
    original_float = torch.Tensor.float

    def tensor_float(self, *args, **kwargs):
        return original_float(self, *args, **kwargs) if self.is_complex() else self.double(*args, **kwargs)

    torch.Tensor.float = tensor_float


# -- where a rank is when verify's timeout is hit --------------------------

_DUMP_FILES = []  # open while the process runs: faulthandler writes into it on SIGUSR1


def _register_stack_dump(out_dir):
    """On SIGUSR1, every thread's stack into stack_{pid}.txt; this process's pid into pid_rank{r}.json.
    Only the rank's first process does: a DataLoader worker started with spawn imports this module
    too, and finds the rank's pid file there already."""
    import faulthandler
    import signal

    rank = int(os.environ.get("RANK", "0"))
    if not hasattr(signal, "SIGUSR1"):
        return
    path = os.path.join(out_dir, f"pid_rank{rank}.json")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except OSError:  # not the rank's first process (or no folder to write in)
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write('{"pid": %d, "rank": %d}' % (os.getpid(), rank))
    dump = open(os.path.join(out_dir, f"stack_{os.getpid()}.txt"), "w")
    _DUMP_FILES.append(dump)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True, chain=False)


def _write_json(path, data):
    import json

    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _state_init_step():
    """True inside torch.distributed.checkpoint's ``_init_optim_state``: the
    ``step()`` it takes at lr 0 on zero gradients to create the optimizer state
    (get/set_optimizer_state_dict before the first step, e.g. on resume) is
    not a training step. Called by the step hooks: frame 2 is their caller."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code.co_name == "_init_optim_state" and "checkpoint" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


# -- the samples each step read, and the epochs the samplers were at ------


def _leading_size(batch, depth=0):
    """The first dimension of the batch's first tensor (a tuple, list or dict of them)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if depth > 3:
        return None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = _leading_size(item, depth + 1)
        if size is not None:
            return size
    return None


def _wrap_loaders(state):
    try:
        from torch.utils.data import DistributedSampler
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        original_next = _BaseDataLoaderIter.__next__

        def counting_next(self):
            key = id(getattr(self, "_index_sampler", None))
            if state["stopped"] and key in state["training_loaders"]:
                raise StopIteration  # to_end: the training passes end here; evaluation loaders go on
            batch = original_next(self)
            if not state["done"]:
                try:
                    state["last_loader"] = key
                    state["last_batch"] = _leading_size(batch) or 0
                except Exception:
                    pass
            return batch

        _BaseDataLoaderIter.__next__ = counting_next

        original_dist_iter = DistributedSampler.__iter__

        def recording_iter(self):
            if self.shuffle and not state["done"]:
                state["sampler_epochs"].append(int(self.epoch))
            return original_dist_iter(self)

        DistributedSampler.__iter__ = recording_iter

        if os.environ.get("FSDP2_RETROFIT_VERIFY_MODE") == "dist":
            from torch.utils.data import RandomSampler

            original_random_iter = RandomSampler.__iter__

            def recording_random_iter(self):
                # a shuffled pass the retrofit left to a RandomSampler (a loader it did not split,
                # e.g. an evaluation loader): recorded as -1 in the order of the passes, so the
                # single run's reference sampler lets that pass draw as the original does
                if not state["done"] and not self.replacement and self.num_samples == len(self.data_source):
                    state["sampler_epochs"].append(-1)
                return original_random_iter(self)

            RandomSampler.__iter__ = recording_random_iter
    except Exception:
        pass


# -- writing the record ---------------------------------------------------


def _peak_memory():
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "cuda", int(torch.cuda.max_memory_allocated())
    # ru_maxrss: KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "rss", int(rss if sys.platform == "darwin" else rss * 1024)


def _gather_params(params):
    tensors = []
    for p in params:
        t = p.detach()
        if _is_dtensor(t):
            t = t.full_tensor()
        tensors.append(t.cpu().clone())
    return tensors


def _write_record(state, out_dir, rank, reason, weights):
    """rank{rank}.json: what this process recorded (`weights`: whether it gathered them)."""
    import json
    import time

    kind, peak = _peak_memory()
    group = _dist()
    try:
        backend = str(group.get_backend()) if group is not None else None
    except Exception:
        backend = None
    record = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "reason": reason,
        "steps": state["step"],
        "losses": state["losses"],
        "grad_norms": state["grad_norms"][: state["step"]],
        "param_grad_norms": state["param_grad_norms"][: state["step"]],
        "params": state.get("params", []),
        "loss_dtype": state["dtypes"]["loss"],
        "grad_dtype": state["dtypes"]["grad"],
        "compute_dtype": state["dtypes"]["compute"],
        "dtype_mode": os.environ.get("FSDP2_RETROFIT_VERIFY_DTYPE") or "native",
        "micro_steps": state["micro_steps"],
        "step_seconds": [b - a for a, b in zip(state["step_ends"], state["step_ends"][1:])],
        "samples": state["samples"],
        "sampler_epochs": state["sampler_epochs"],
        "weights": weights,
        "memory_kind": kind,
        "peak_memory_bytes": peak,
        "backend": backend,  # the default process group's ("nccl", "cpu:gloo,cuda:nccl"), None without one
        "failed": state["failed"],
        "seconds": time.time() - state["started"],
    }
    tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))


def _wrap_process_group(run):
    # the script ends before K steps: record while the ranks are still together
    state = run.state
    try:
        import torch.distributed as _d

        original_destroy = _d.destroy_process_group

        def destroy_process_group(*args, **kwargs):
            state["grouped"] = True
            if not state["done"] and not args and not kwargs.get("group"):
                run.finish("end", gather=True)
            return original_destroy(*args, **kwargs)

        _d.destroy_process_group = destroy_process_group

        original_init = _d.init_process_group

        def init_process_group(*args, **kwargs):
            state["grouped"] = True
            return original_init(*args, **kwargs)

        _d.init_process_group = init_process_group
    except Exception:
        pass


def _wrap_exits(state):
    """The exception that ends the script, and what it gives sys.exit: its exit record says how it ended."""
    original_excepthook = sys.excepthook

    def excepthook(kind, value, tb):
        state["failed"] = state["uncaught"] = f"{kind.__name__}: {value}"
        original_excepthook(kind, value, tb)

    sys.excepthook = excepthook

    original_exit = sys.exit

    def recording_exit(status=None):
        state["exit_status"] = status
        original_exit(status)

    sys.exit = recording_exit


def _install_reference_sampler():
    import torch
    from torch.utils.data import RandomSampler

    original_iter = RandomSampler.__iter__
    # FSDP2_RETROFIT_VERIFY_EPOCHS: the epochs the distributed run's shuffled samplers were at,
    # pass by pass ("1,2,3" for a script that counts epochs from 1); the single run's shuffled
    # passes take them in the same order. Without it, each sampler counts its passes from 0.
    given = [int(e) for e in os.environ.get("FSDP2_RETROFIT_VERIFY_EPOCHS", "").split(",") if e.strip()]
    passes = [0]

    def reference_iter(self):
        n = len(self.data_source)
        if self.replacement or self.num_samples != n:
            return original_iter(self)
        epoch = getattr(self, "_fsdp2_verify_epoch", 0)
        self._fsdp2_verify_epoch = epoch + 1
        if given:
            i = passes[0]
            passes[0] += 1
            if i < len(given) and given[i] < 0:
                return original_iter(self)  # the distributed run left this pass to a RandomSampler too
            split = [e for e in given if e >= 0]
            later = sum(1 for e in given if e >= 0) + i - len(given)  # passes after the recorded ones
            epoch = given[i] if i < len(given) else (split[-1] + 1 + later if split else later)
        generator = torch.Generator()
        generator.manual_seed(0 + epoch)  # DistributedSampler: seed + epoch
        return iter(torch.randperm(n, generator=generator).tolist())

    RandomSampler.__iter__ = reference_iter


if _active():
    try:
        _install()
    except Exception as _exc:  # never break the user's script; verify reports the missing record
        sys.stderr.write(f"fsdp2-retrofit verify: instrumentation failed: {type(_exc).__name__}: {_exc}\n")
if os.environ.get("FSDP2_RETROFIT_VERIFY_SAMPLER") == "1":
    _install_reference_sampler()

_chain_shadowed_sitecustomize()

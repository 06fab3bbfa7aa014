"""shared_names (issue 32 B1): a path every rank uses, named from the clock or a uuid, is
rank 0's on every rank (broadcast right after it is made), or the file is refused at the
line that makes it. Timers (`t0 = time.time()`) that reach no path are left alone.
The fixture run_dir_clock shows the output trains like the original and that without the
broadcast rank 1's checkpoint lands in a folder of its own."""
from __future__ import annotations

from textwrap import dedent, indent

from fsdp2_retrofit.pipeline import rewrite_source

HEAD = dedent('''\
    import os
    import time
    import uuid

    import torch
    import torch.nn as nn

    {top}

    def main():
        torch.manual_seed(0)
    {body}
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = model(torch.randn(2, 4)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    {tail}


    main()
    ''')


def _rewrite(body: str, tail: str = "", top: str = ""):
    source = HEAD.format(top=top, body=indent(dedent(body), "    "), tail=indent(dedent(tail), "    "))
    return rewrite_source(source.encode(), "/tmp/shared_names_case.py")


def _code(result) -> str:
    return result.code.decode()


def test_a_clock_named_run_folder_is_broadcast_from_rank_zero():
    result = _rewrite('run_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))\n'
                      "os.makedirs(run_dir, exist_ok=True)\n",
                      'torch.save(model.state_dict(), os.path.join(run_dir, "m.pt"))\n')
    assert not result.refusals
    code = _code(result)
    assert ('    run_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))\n'
            "    run_dir_shared = [run_dir]\n"
            "    dist.broadcast_object_list(run_dir_shared, src=0)  # every rank: one name for the run\n"
            "    run_dir = run_dir_shared[0]\n"
            "    os.makedirs(run_dir, exist_ok=True)\n") in code
    # the process group starts before the name is made
    assert code.index("dist.init_process_group(") < code.index("run_dir = os.path.join(")
    assert any(c.code == "shared_names" for c in result.changes)


def test_a_uuid_through_an_attribute_of_args_is_broadcast():
    result = _rewrite("class A:\n    pass\nargs = A()\nargs.out = f\"runs/{uuid.uuid4().hex[:8]}\"\n",
                      "torch.save(model.state_dict(), args.out)\n")
    assert "out_shared = [args.out]\n" in _code(result)
    assert "args.out = out_shared[0]\n" in _code(result)


def test_a_timer_reaching_no_path_is_left_alone():
    result = _rewrite("t0 = time.time()\n", 'print(f"took {time.time() - t0:.1f}s")\n'
                      'torch.save(model.state_dict(), "m.pt")\n')
    assert "broadcast_object_list" not in _code(result)
    assert not result.refusals


def test_the_same_run_renamed_gives_the_same_edit():
    a = _rewrite('d = "runs/" + str(int(time.time()))\n', 'torch.save(model.state_dict(), d + "/m.pt")\n')
    b = _rewrite('where = "runs/" + str(int(time.time()))\n', 'torch.save(model.state_dict(), where + "/m.pt")\n')
    assert _code(a).replace("where", "d") == _code(b).replace("where", "d")
    assert "broadcast_object_list(d_shared" in _code(a)


def test_a_clock_path_handed_straight_to_the_save_is_refused_at_its_line():
    result = _rewrite("", 'torch.save(model.state_dict(), f"ckpt-{time.time()}.pt")\n')
    assert [r.code for r in result.refusals] == ["FSR636"]
    assert "time.time()" in result.refusals[0].what


def test_a_module_level_run_name_is_refused():
    result = _rewrite("", 'torch.save(model.state_dict(), RUN + "/m.pt")\n',
                      top='RUN = "runs/" + time.strftime("%H%M%S")\n')
    assert [r.code for r in result.refusals] == ["FSR635"]


def test_a_name_made_by_a_function_called_after_the_group_starts_is_broadcast_inside_it():
    top = ('def make_run_dir(root):\n'
           '    d = os.path.join(root, time.strftime("%Y%m%d-%H%M%S"))\n'
           '    os.makedirs(d, exist_ok=True)\n'
           '    return d\n')
    result = _rewrite("", 'out = make_run_dir("runs")\ntorch.save(model.state_dict(), out + "/m.pt")\n', top=top)
    assert not result.refusals
    assert ('    d = os.path.join(root, time.strftime("%Y%m%d-%H%M%S"))\n'
            "    d_shared = [d]\n") in _code(result)


def test_a_second_rewrite_adds_no_second_broadcast():
    first = _rewrite('run_dir = "runs/" + time.strftime("%H%M%S")\n', 'torch.save(model.state_dict(), run_dir)\n')
    again = rewrite_source(first.code, "/tmp/shared_names_case.py")
    assert again.code == first.code

"""files.py: reading scripts with one-line errors, and atomic writes that keep the file's mode."""
from __future__ import annotations

import os
import stat

import pytest

from fsdp2_retrofit import files
from fsdp2_retrofit.report import InputError


def write(tmp_path, data: bytes, name: str = "train.py"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def read_error(path) -> InputError:
    with pytest.raises(InputError) as info:
        files.read_source(path)
    return info.value


def test_reads_utf8_by_default(tmp_path):
    path = write(tmp_path, "x = 'é'\n".encode())
    source = files.read_source(path)
    assert source.data == path.read_bytes()
    assert source.encoding == "utf-8"


def test_reads_declared_latin1(tmp_path):
    data = "# -*- coding: latin-1 -*-\n# café\nx = 1\n".encode("latin-1")
    source = files.read_source(write(tmp_path, data))
    assert source.data == data
    assert source.decode() == data.decode("latin-1")


def test_cookie_on_second_line_after_shebang(tmp_path):
    data = "#!/usr/bin/env python\n# coding: latin-1\n# café\n".encode("latin-1")
    assert files.read_source(write(tmp_path, data)).data == data


def test_reads_utf8_with_bom(tmp_path):
    data = b"\xef\xbb\xbfx = 1\r\n"
    assert files.read_source(write(tmp_path, data)).data == data


def test_missing_path(tmp_path):
    assert read_error(tmp_path / "nope.py").message == "no such file or directory"


def test_directory(tmp_path):
    assert read_error(tmp_path).message == "is a directory; rewrite takes script files"


def test_binary_reports_line_of_first_nul(tmp_path):
    err = read_error(write(tmp_path, b"x = 1\ny = 2\n\x00\x01\x02"))
    assert err.message.startswith("binary file")
    assert err.line == 3


@pytest.mark.parametrize("data", [b"", b"\n\n", b"  \t\r\n", b"\xef\xbb\xbf\n"])
def test_empty_or_whitespace_only(tmp_path, data):
    assert read_error(write(tmp_path, data)).message == "empty file: nothing to retrofit"


def test_unknown_cookie_encoding(tmp_path):
    err = read_error(write(tmp_path, b"#!/usr/bin/env python\n# coding: no-such-codec\nx = 1\n"))
    assert err.message == "unknown encoding in coding cookie: no-such-codec"
    assert err.line == 2


def test_cookie_naming_a_non_text_codec(tmp_path):
    err = read_error(write(tmp_path, b"# coding: rot13\nx = 1\n"))
    assert "rot13 is not a text encoding" in err.message
    assert err.line == 1


def test_bom_contradicting_cookie(tmp_path):
    err = read_error(write(tmp_path, b"\xef\xbb\xbf# coding: latin-1\nx = 1\n"))
    assert "byte-order mark" in err.message
    assert err.line == 1


def test_undecodable_bytes_report_their_line(tmp_path):
    err = read_error(write(tmp_path, b"x = 1\ny = 2\n# caf\xe9\n"))
    assert err.message.startswith("cannot decode byte 0xe9 as utf-8 (the default encoding)")
    assert err.line == 3


def test_undecodable_first_line(tmp_path):
    err = read_error(write(tmp_path, b"# caf\xe9\nx = 1\n"))
    assert err.message.startswith("cannot decode byte 0xe9 as utf-8")
    assert err.line == 1


def test_undecodable_with_declared_encoding(tmp_path):
    err = read_error(write(tmp_path, b"# coding: ascii\n# caf\xe9\n"))
    assert err.message.startswith("cannot decode byte 0xe9 as ascii (the declared encoding)")
    assert err.line == 2


def test_check_writable_uses_mode_bits(tmp_path):
    # As root os.access() says yes; the mode bits still say read-only.
    path = write(tmp_path, b"x = 1\n")
    path.chmod(0o444)
    with pytest.raises(InputError, match="read-only file"):
        files.check_writable(path)
    path.chmod(0o644)
    files.check_writable(path)
    files.check_writable(tmp_path / "new.py")  # a new file is fine


def test_atomic_write_keeps_mode_and_leaves_no_temp_file(tmp_path):
    path = write(tmp_path, b"old\n")
    path.chmod(0o751)
    files.atomic_write(path, b"new\r\n")
    assert path.read_bytes() == b"new\r\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o751
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_atomic_write_new_file_follows_umask(tmp_path):
    old = os.umask(0o027)
    try:
        files.atomic_write(tmp_path / "out.py", b"x = 1\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.py").stat().st_mode) == 0o640


def test_atomic_write_through_symlink_keeps_the_link(tmp_path):
    real = write(tmp_path, b"old\n", "real.py")
    link = tmp_path / "link.py"
    link.symlink_to(real)
    files.atomic_write(link, b"new\n")
    assert link.is_symlink()
    assert real.read_bytes() == b"new\n"


def test_atomic_write_failure_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="cannot write: no such file or directory"):
        files.atomic_write(tmp_path / "missing-dir" / "out.py", b"x = 1\n")


# -- a set of files: all or none ------------------------------------------------------------

_KILL_AFTER_FIRST_RENAME = """
import os, sys
sys.path.insert(0, {repo!r})
from fsdp2_retrofit import files
real = os.replace
done = []
def replace(src, dst):
    real(src, dst)
    if not dst.endswith(files.JOURNAL):
        done.append(dst)
        if len(done) == 1:
            os._exit(9)  # killed between the renames
os.replace = replace
files.write_all([({a!r}, b"new a"), ({b!r}, b"new b")])
"""


def test_a_writer_killed_between_renames_is_finished_by_the_next_run(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_bytes(b"old a")
    b.write_bytes(b"old b")
    repo = str(Path(__file__).resolve().parents[1])
    code = _KILL_AFTER_FIRST_RENAME.format(repo=repo, a=str(a), b=str(b))
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert (tmp_path / files.JOURNAL).exists()  # committed, not finished
    assert (a.read_bytes(), b.read_bytes()) == (b"new a", b"old b")
    notes = files.finish_interrupted(tmp_path)
    assert len(notes) == 1 and "b.py: written" in notes[0]
    assert (a.read_bytes(), b.read_bytes()) == (b"new a", b"new b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "b.py"]


def test_a_writer_killed_before_the_commit_changes_nothing(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_bytes(b"old a")
    b.write_bytes(b"old b")
    repo = str(Path(__file__).resolve().parents[1])
    code = (f"import os, sys\nsys.path.insert(0, {repo!r})\nfrom fsdp2_retrofit import files\n"
            "files.atomic_write = lambda *a, **k: os._exit(9)\n"  # the journal is the commit point
            f"files.write_all([({str(a)!r}, b'new a'), ({str(b)!r}, b'new b')])\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert files.finish_interrupted(tmp_path) == []
    assert (a.read_bytes(), b.read_bytes()) == (b"old a", b"old b")


def test_a_file_edited_after_the_kill_is_kept(tmp_path):
    import json

    a = tmp_path / "a.py"
    a.write_bytes(b"edited by hand")
    staged = tmp_path / ".a.py.x.tmp"
    staged.write_bytes(b"new a")
    (tmp_path / files.JOURNAL).write_text(json.dumps([{"staged": str(staged), "target": str(a), "before": "0" * 64}]))
    notes = files.finish_interrupted(tmp_path)
    assert notes == [f"{a}: changed since an interrupted rewrite; kept as it is"]
    assert a.read_bytes() == b"edited by hand" and not staged.exists()


def test_a_failed_staging_leaves_every_file_and_no_temp(tmp_path):
    a = tmp_path / "a.py"
    a.write_bytes(b"old a")
    with pytest.raises(InputError):
        files.write_all([(str(a), b"new a"), (str(tmp_path / "missing" / "b.py"), b"new b")])
    assert a.read_bytes() == b"old a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py"]

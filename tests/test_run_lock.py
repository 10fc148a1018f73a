"""One run of a name at a time in a run's folders (trainer/mechanics/run_lock.py): held by another process, the
name is refused in one line naming it, and a lock taken in the other folder first is let go; other names share
the folders; the holder's end frees them and removes its file; a folder that cannot be written is one line, and
one whose filesystem takes no locks a warning."""
import errno
import os
import subprocess
import sys

import pytest

from model.errors import UserError
from trainer.mechanics.distributed import DistInfo
from trainer.mechanics.run_lock import hold_run_folders

HOLD = """import sys
sys.path.insert(0, {repo!r})
from trainer.mechanics.distributed import DistInfo
from trainer.mechanics.run_lock import hold_run_folders
held = hold_run_folders([{folder!r}], "pretrain_tiny", DistInfo())
print("held", flush=True)
sys.stdin.read()
"""


def test_a_held_name_is_refused_and_freed_when_its_holder_ends(tmp_path):
    out, other = tmp_path / "out", tmp_path / "other"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=repo, folder=str(out))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"another run \(pid {holder.pid} on .*\) is writing pretrain_tiny into "
                                            rf"{out}: wait for it to end"):
            hold_run_folders([str(other), str(out)], "pretrain_tiny", DistInfo())
        assert not (other / "pretrain_tiny.lock").exists()  # the folder it had locked first: let go
        assert len(hold_run_folders([str(out)], "lora_demo_tiny", DistInfo()).files) == 1  # another name
    finally:
        holder.communicate("")  # its end: the lock freed, its file removed
    assert holder.returncode == 0 and not (out / "pretrain_tiny.lock").exists()
    held = hold_run_folders([str(out), str(out / ".." / "out")], "pretrain_tiny", DistInfo())  # one folder, once
    assert len(held.files) == 1 and (out / "pretrain_tiny.lock").read_text().startswith(f"pid {os.getpid()} on ")
    del held
    assert not (out / "pretrain_tiny.lock").exists()


def test_a_folder_that_cannot_take_the_lock_is_one_line_or_a_warning(tmp_path, monkeypatch, capsys):
    import fcntl

    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match="cannot write into .*a_file/sub: .*; pass a --out_dir and --save_dir"):
        hold_run_folders([str(tmp_path / "a_file" / "sub")], "pretrain_tiny", DistInfo())

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)  # as NFSv3 without lockd says
    assert hold_run_folders([str(tmp_path / "out")], "pretrain_tiny", DistInfo()).files == []
    assert "takes no file locks (No locks available)" in capsys.readouterr().err

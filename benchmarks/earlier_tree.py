"""An earlier commit of this repository, checked out to measure against (a temporary git worktree
whose horovod_gift imports with this tree's virtual environment: its kernels/ linked in as
horovod_gift.kernels, as the editable install maps it). Put it on PYTHONPATH."""
import contextlib
import pathlib
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def earlier_tree(commit):
    """The checkout's path for the block, or None without a commit."""
    if commit is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as scratch:
        old = pathlib.Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), commit], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            (old / "horovod_gift" / "kernels").symlink_to(old / "kernels")
            yield old
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT,
                           check=True)

"""What `pip install .` gives a GPU-cluster user whose environment already has Horovod: a wheel
that does not ask pip for Horovod (pip would try to rebuild it), carries the kernels, states the
version the package reports, and a test extra with everything the tests import."""
import pathlib
import subprocess
import sys
import zipfile

import horovod_gift

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wheel_metadata_version_requirements_and_kernels(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path), str(ROOT)], check=True, cwd=tmp_path)
    wheel, = tmp_path.glob("horovod_gift-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert f"Version: {horovod_gift.__version__}\n" in metadata
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    assert not any(r.lower().startswith("horovod") for r in requires), requires
    test_extra = {r.split(";")[0].strip().lower() for r in requires if "extra == \"test\"" in r}
    assert {"pytest", "pytest-timeout", "hypothesis", "mpi4py", "numpy", "tqdm"} <= test_extra
    assert "horovod_gift/kernels/hadamard.py" in names and "horovod_gift/hvd/compressor.py" in names

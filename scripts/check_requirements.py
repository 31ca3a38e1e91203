"""Exit non-zero unless every pinned requirement is importable at its pinned version."""
import importlib.metadata as md
import pathlib
import sys

missing = []
for line in (pathlib.Path(__file__).parent.parent / "requirements.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    try:
        installed = md.version(name)
    except md.PackageNotFoundError:
        missing.append(f"{name}: not installed")
        continue
    if version and installed.split("+")[0] != version:
        missing.append(f"{name}: {installed} installed, {version} required")
print("\n".join(missing) or "all requirements present")
sys.exit(1 if missing else 0)

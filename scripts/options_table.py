"""The README's table of options, made from horovod_gift/config.py: each GiftConfig field, its
default under Horovod and DDP, FSDP2 and DiLoCo ("refused" where that frontend takes no value but
the default), and the comment on the field. One list of options: change an option in config.py,
then run this to rewrite the table.

    python scripts/options_table.py            # rewrites README.md's table
    python scripts/options_table.py --check    # exits 1 if README.md's table is another
"""
import argparse
import ast
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "horovod_gift" / "config.py"
README = ROOT / "README.md"
BEGIN = "<!-- options: made by scripts/options_table.py from horovod_gift/config.py -->"
END = "<!-- /options -->"


def comments(source):
    """Each GiftConfig field's comment (the comment lines right above it), joined."""
    lines = source.splitlines()
    config = next(node for node in ast.parse(source).body
                  if isinstance(node, ast.ClassDef) and node.name == "GiftConfig")
    found = {}
    for node in config.body:
        if isinstance(node, ast.AnnAssign):
            above = node.lineno - 2
            block = []
            while above >= 0 and lines[above].strip().startswith("#"):
                block.insert(0, lines[above].strip().lstrip("#").strip())
                above -= 1
            found[node.target.id] = " ".join(block)
    return found


def shown(value):
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def table(source=None):
    from horovod_gift.config import (
        DILOCO_REFUSED,
        FSDP_REFUSED,
        HOROVOD_DDP_REFUSED,
        GiftConfig,
    )
    said = comments(CONFIG.read_text() if source is None else source)
    frontends = [(GiftConfig(), HOROVOD_DDP_REFUSED), (GiftConfig.for_fsdp(), FSDP_REFUSED),
                 (GiftConfig.for_diloco(), DILOCO_REFUSED)]
    rows = ["| option | Horovod / DDP | FSDP2 | DiLoCo | what it does, and when to change it |",
            "|---|---|---|---|---|"]
    for field in dataclasses.fields(GiftConfig):
        if not said.get(field.name):
            raise SystemExit(f"options_table.py: GiftConfig.{field.name} has no comment")
        cells = ["refused" if field.name in refused else shown(getattr(config, field.name))
                 for config, refused in frontends]
        rows.append(f"| `{field.name}` | " + " | ".join(cells) + " | "
                    + said[field.name].replace("|", "\\|") + " |")
    return "\n".join([BEGIN, *rows, END])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    readme = README.read_text()
    if BEGIN not in readme or END not in readme:
        sys.exit(f"options_table.py: README.md has lost its markers {BEGIN} ... {END}")
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    made = table()
    if args.check:
        sys.exit(0 if readme[start:end] == made else "README.md's table of options is not "
                 "config.py's: run python scripts/options_table.py")
    README.write_text(readme[:start] + made + readme[end:])


if __name__ == "__main__":
    main()

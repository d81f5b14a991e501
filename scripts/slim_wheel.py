"""Copy a wheel without some of its top-level directories, e.g. the NIXL wheel without the expert-
parallel extension this project does not use, so it fits what the GPU machine takes (64 MiB):

python scripts/slim_wheel.py .whl/nixl_cu13-1.5.1-*.whl nixl_ep_cu13 --out .whl

Writes the wheel under the same file name into ``--out`` (replacing it there) with the directories'
files removed from the archive and from its RECORD, so pip installs it as usual.
"""
import argparse
import os
import tempfile
import zipfile
from pathlib import Path


def slim(wheel: Path, drop: list[str], out_dir: Path) -> Path:
    """The wheel without the files under the top-level directories ``drop``; returns its path."""
    dropped = tuple(d.rstrip("/") + "/" for d in drop)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, tempfile.NamedTemporaryFile(
            dir=out_dir, suffix=".whl", delete=False) as tmp:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename.startswith(dropped):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(x for x in lines if not x.startswith(dropped)).encode()
                dst.writestr(info, data)
    os.replace(tmp.name, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("drop", nargs="+", help="top-level directories to leave out")
    parser.add_argument("--out", type=Path, required=True, help="directory for the slimmed wheel")
    args = parser.parse_args()
    before = args.wheel.stat().st_size
    target = slim(args.wheel, args.drop, args.out)
    print(f"{target}: {before / 2**20:.1f} -> {target.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

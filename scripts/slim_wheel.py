"""Copy a wheel without the parts this project does not use, so it fits what the GPU machine takes
(64 MiB with the tree and a fixture):

python scripts/slim_wheel.py .whl/nixl_cu13-1.5.1-*.whl nixl_ep_cu13 --out .whl \\
    --only-needed-by libnixl.so _bindings libplugin_UCX.so libplugin_POSIX.so ucx/

drops the top-level directories named (here NIXL's expert-parallel extension: 56 -> 29 MiB) and,
with ``--only-needed-by``, every shared library that none of the libraries whose paths contain one
of the given strings needs, directly or through others (ELF ``NEEDED`` entries, read with
``readelf``): the transfer plugins other than UCX and POSIX and the object-store SDKs they link
(29 -> 18 MiB). Writes the wheel under the same file name into ``--out`` (replacing it there) with
the files removed from the archive and from its RECORD, so pip installs it as usual.
"""
import argparse
import os
import re
import subprocess
import tempfile
import zipfile
from pathlib import Path, PurePosixPath


def _shared_library(name: str) -> bool:
    return re.search(r"\.so(\.|$)", PurePosixPath(name).name) is not None


def unneeded_libraries(wheel: zipfile.ZipFile, roots: list[str]) -> set[str]:
    """The shared libraries of ``wheel`` that no library whose path contains one of ``roots``
    needs, directly or through other libraries of the wheel (by file name, as the loader finds
    them through the wheel's rpaths)."""
    libs = [n for n in wheel.namelist() if _shared_library(n)]
    by_name = {PurePosixPath(n).name: n for n in libs}
    with tempfile.TemporaryDirectory() as tmp:
        def needed(member: str) -> list[str]:
            path = wheel.extract(member, tmp)
            dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                                     check=True).stdout
            return re.findall(r"\(NEEDED\).*\[(.+)\]", dynamic)

        keep, todo = set(), [n for n in libs if any(r in n for r in roots)]
        while todo:
            member = todo.pop()
            if member not in keep:
                keep.add(member)
                todo += [by_name[n] for n in needed(member) if n in by_name]
    return set(libs) - keep


def slim(wheel: Path, drop: list[str], out_dir: Path, needed_by: list[str] | None = None) -> Path:
    """The wheel without the files under the top-level directories ``drop`` and, given
    ``needed_by``, without the shared libraries those do not need (``unneeded_libraries``);
    returns its path."""
    dropped_dirs = tuple(d.rstrip("/") + "/" for d in drop)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src:
        gone = {n for n in src.namelist() if n.startswith(dropped_dirs)}
        if needed_by:
            gone |= unneeded_libraries(src, needed_by) - gone
        with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".whl", delete=False) as tmp:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
                for info in src.infolist():
                    if info.filename in gone:
                        continue
                    data = src.read(info)
                    if info.filename.endswith(".dist-info/RECORD"):
                        lines = data.decode().splitlines(keepends=True)
                        data = "".join(x for x in lines if x.split(",")[0] not in gone).encode()
                    dst.writestr(info, data)
    os.replace(tmp.name, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("drop", nargs="*", help="directories (paths inside the wheel) to leave out")
    parser.add_argument("--out", type=Path, required=True, help="directory for the slimmed wheel")
    parser.add_argument("--only-needed-by", nargs="+", metavar="PATH_PART",
                        help="keep only the shared libraries that the libraries whose paths "
                             "contain one of these need")
    args = parser.parse_args()
    before = args.wheel.stat().st_size
    target = slim(args.wheel, args.drop, args.out, args.only_needed_by)
    print(f"{target}: {before / 2**20:.1f} -> {target.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

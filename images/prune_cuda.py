"""Deletes the CUDA libraries of PyPI's torch that a CPU-only process never loads (CPU image only).

PyPI's torch for Linux is the CUDA build: libtorch_cuda.so links against cudart, cuBLAS, cuFFT,
cuSPARSE, NCCL, cuDNN's loader and a few more, so those must stay or `import torch` fails. Everything
else the nvidia-* wheels ship is opened only with dlopen() once a GPU is in use (cuDNN's engine
libraries, cuSOLVER, headers, NVSHMEM device code). This keeps exactly the DT_NEEDED closure of the
ELF files outside nvidia/ and deletes every other file under nvidia/.
  python prune_cuda.py SITE_PACKAGES
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

PT_LOAD, PT_DYNAMIC, DT_NEEDED, DT_STRTAB = 1, 2, 1, 5


def needed(path: Path) -> list[str]:
    """The DT_NEEDED sonames of a 64-bit little-endian ELF file ([] for anything else)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize
        )
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return []
    entries, strtab = [], None
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == DT_NEEDED:
            entries.append(value)
        elif tag == DT_STRTAB:
            strtab = next(
                value - vaddr + offset
                for vaddr, offset, size in loads
                if vaddr <= value < vaddr + size
            )
    if strtab is None:
        return []
    return [data[strtab + e : data.index(b"\0", strtab + e)].decode() for e in entries]


def is_elf_candidate(path: Path) -> bool:
    return (
        path.is_file()
        and not path.is_symlink()
        and (path.suffix == ".so" or ".so." in path.name)
    )


def main(site: Path) -> int:
    nvidia = site / "nvidia"
    if not nvidia.is_dir():
        print(f"prune_cuda: no {nvidia}, nothing to prune", file=sys.stderr)
        return 0
    by_soname: dict[str, Path] = {}
    for path in nvidia.rglob("*"):
        if is_elf_candidate(path):
            by_soname.setdefault(path.name, path)
    roots = [
        p for p in site.rglob("*") if is_elf_candidate(p) and nvidia not in p.parents
    ]
    keep: set[Path] = set()
    todo = [name for root in roots for name in needed(root)]
    while todo:
        lib = by_soname.get(todo.pop())
        if lib is not None and lib not in keep:
            keep.add(lib)
            todo.extend(needed(lib))
    removed = 0
    for path in sorted(nvidia.rglob("*"), reverse=True):
        if (
            path.is_file()
            and path not in keep
            and not path.name.endswith((".py", "METADATA", "RECORD"))
        ):
            removed += path.stat().st_size
            path.unlink()
    for path in sorted(nvidia.rglob("*"), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    kept = sum(p.stat().st_size for p in keep)
    print(f"prune_cuda: kept {len(keep)} CUDA libraries ({kept / 2**20:.0f} MiB), "
          f"removed {removed / 2**20:.0f} MiB", file=sys.stderr)  # fmt: skip
    for path in sorted(keep):
        print(f"  kept {path.relative_to(site)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

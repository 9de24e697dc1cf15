#!/usr/bin/env python3
"""Prunes an unpacked root file system to the shared libraries its programs can load.

Usage: elf_closure.py ROOT [--keep NAME]...

Debian's python3-torch drags in OpenCV, FFmpeg, Qt, GDAL and Mesa through package
dependencies; most of those libraries are never loaded by anything in the image. This walks
the dynamic-linker graph inside ROOT the way ld.so would (DT_NEEDED through DT_RPATH/DT_RUNPATH
with $ORIGIN, /etc/ld.so.conf.d, the multiarch defaults), starting from every ELF file outside
the top-level library directory (programs, Python extension modules, plugin directories, and
symlinks into it from elsewhere, which is how torch dlopens its libraries), and
removes the top-level libraries (usr/lib/x86_64-linux-gnu/*.so*) nothing reaches. --keep names
libraries kept anyway (loaded with dlopen by name, e.g. libgcc_s.so.1 by glibc).

Exits 1 naming every DT_NEEDED that resolves nowhere: a package left out that something
still links against is an error at build time, not at a pod's start. Prints a summary on
stderr. Only ELF64 little-endian objects are read (x86_64).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import sys

LIBDIR = "usr/lib/x86_64-linux-gnu"
DEFAULT_DIRS = ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib", "/usr/lib"]
PT_LOAD, PT_DYNAMIC = 1, 2
DT_NEEDED, DT_STRTAB, DT_RPATH, DT_RUNPATH = 1, 5, 15, 29


def is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def dynamic(path: str) -> tuple[list[str], list[str]]:
    """DT_NEEDED names and the search path (RUNPATH, else RPATH) of an ELF64 object."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[4] != 2 or m[5] != 1:  # ELFCLASS64, little-endian
            return [], []
        phoff, = struct.unpack_from("<Q", m, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", m, 0x36)
        loads, dyn = [], None
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", m, phoff + i * phentsize)
            if p_type == PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == PT_DYNAMIC:
                dyn = (p_offset, p_filesz)
        if dyn is None:
            return [], []
        entries = []
        for off in range(dyn[0], dyn[0] + dyn[1], 16):
            tag, val = struct.unpack_from("<qQ", m, off)
            if tag == 0:
                break
            entries.append((tag, val))
        strtab = next((v for t, v in entries if t == DT_STRTAB), None)
        if strtab is None:
            return [], []
        base = next((o + strtab - a for a, o, s in loads if a <= strtab < a + s), None)
        if base is None:
            return [], []

        def string(at: int) -> str:
            end = m.find(b"\0", base + at)
            return m[base + at:end].decode()

        needed = [string(v) for t, v in entries if t == DT_NEEDED]
        runpath = [string(v) for t, v in entries if t == DT_RUNPATH]
        rpath = [string(v) for t, v in entries if t == DT_RPATH]
        dirs = [d for p in (runpath or rpath) for d in p.split(":") if d]
        return needed, dirs


class Root:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.conf_dirs = self._ld_so_conf()

    def host(self, path: str) -> str:
        return self.root + path

    def resolve(self, path: str) -> tuple[str | None, list[str]]:
        """The real in-root path of `path` (absolute, in-root) following symlinks as they
        would be followed inside the root, and every symlink passed on the way."""
        hops: list[str] = []
        parts = [p for p in path.split("/") if p]
        done = ""
        for _ in range(64):
            if not parts:
                return (done or "/"), hops
            part = parts.pop(0)
            if part == "..":
                done = os.path.dirname(done)
                continue
            if part == ".":
                continue
            candidate = done + "/" + part
            try:
                st = os.lstat(self.host(candidate))
            except OSError:
                return None, hops
            if stat.S_ISLNK(st.st_mode):
                hops.append(candidate)
                target = os.readlink(self.host(candidate))
                parts = [p for p in target.split("/") if p] + parts
                if target.startswith("/"):
                    done = ""
            else:
                done = candidate
        return None, hops

    def _ld_so_conf(self) -> list[str]:
        dirs: list[str] = []
        confd = self.host("/etc/ld.so.conf.d")
        if os.path.isdir(confd):
            for name in sorted(os.listdir(confd)):
                if name.endswith(".conf"):
                    with open(os.path.join(confd, name)) as f:
                        dirs += [l.strip() for l in f if l.strip().startswith("/")]
        return dirs

    def find(self, name: str, obj: str, search: list[str]) -> tuple[str | None, list[str]]:
        origin = os.path.dirname(obj)
        dirs = [d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for d in search]
        # Last, the object's own directory: wheels' bundled libraries (h5py.libs, paddle/libs)
        # carry no RUNPATH and find their siblings because the module that links them all loaded
        # them first (ld.so matches an already loaded soname before searching).
        for d in dirs + self.conf_dirs + DEFAULT_DIRS + [origin]:
            path = os.path.normpath(d + "/" + name)
            real, hops = self.resolve(path)
            if real is not None and os.path.isfile(self.host(real)):
                return real, hops + [path]
        return None, []


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    root = Root(argv[0])
    keep = {argv[i + 1] for i, a in enumerate(argv) if a == "--keep"}
    libdir = "/" + LIBDIR
    # Top-level libraries: removable unless reached. Everything else that is ELF is a root.
    candidates = {libdir + "/" + n for n in os.listdir(root.host(libdir)) if ".so" in n}
    todo: list[str] = [libdir + "/" + n for n in keep if libdir + "/" + n in candidates]
    for dirpath, dirnames, filenames in os.walk(root.root):
        rel = dirpath[len(root.root):] or "/"
        for n in filenames:
            p = rel.rstrip("/") + "/" + n
            if p in candidates:
                continue
            # A symlink elsewhere into the library directory is a path something dlopens
            # (torch/lib/libtorch_global_deps.so): its target is a root too.
            if os.path.islink(root.host(p)) or is_elf(root.host(p)):
                todo.append(p)
    kept: set[str] = set()
    seen: set[str] = set()
    missing: list[str] = []
    while todo:
        obj = todo.pop()
        real, hops = root.resolve(obj)
        kept.update(hops)
        if real is None or real in seen:
            continue
        seen.add(real)
        kept.add(real)
        try:
            needed, search = dynamic(root.host(real))
        except (OSError, ValueError, struct.error):
            continue
        for name in needed:
            found, path_hops = root.find(name, real, search)
            if found is None:
                missing.append(f"{real}: {name}")
                continue
            kept.update(path_hops)
            kept.add(found)
            if found not in seen:
                todo.append(found)
    removed = 0
    count = 0
    for c in sorted(candidates - kept):
        h = root.host(c)
        removed += 0 if os.path.islink(h) else os.lstat(h).st_size
        os.unlink(h)
        count += 1
    print(f"elf_closure: {len(seen)} ELF objects reached, {count} unreached libraries removed "
          f"({removed // 1048576} MiB)", file=sys.stderr)
    if missing:
        print("elf_closure: unresolved DT_NEEDED:\n  " + "\n  ".join(sorted(set(missing))), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

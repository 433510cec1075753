"""The newest glibc symbol version each ELF binary needs, read from its version needs.

    python3 glibc.py BINARY...

Prints one line per binary, `<path> GLIBC_<major>.<minor>`, and `max <major>.<minor>` last:
the newest of them, which is the oldest glibc (and so the lowest `manylinux_<major>_<minor>`
tag) the binaries run on. The versions come from the `.gnu.version_r` section (the
`Elf64_Verneed` entries of `libc.so.6`, `libm.so.6`, ... and their `Elf64_Vernaux` names),
exactly what the dynamic loader checks at start; no tool beyond Python is needed.
"""

import re
import struct
import sys

SHT_GNU_VERNEED = 0x6FFFFFFE


def version_needs(path):
    """Every (library, version name) the 64-bit little-endian ELF at `path` needs."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise SystemExit(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        base = shoff + i * shentsize
        _name, kind, _flags, _addr, offset, size, link, info = struct.unpack_from(
            "<IIQQQQII", data, base
        )
        sections.append((kind, offset, size, link, info))
    needs = []
    for kind, offset, _size, link, count in sections:
        if kind != SHT_GNU_VERNEED:
            continue
        strtab = sections[link][1]

        def name_at(off):
            end = data.index(b"\0", strtab + off)
            return data[strtab + off:end].decode()

        entry = offset
        for _ in range(count):
            _version, cnt, file_off, aux, nxt = struct.unpack_from("<HHIII", data, entry)
            library = name_at(file_off)
            vernaux = entry + aux
            for _ in range(cnt):
                _hash, _flags, _other, name_off, aux_next = struct.unpack_from(
                    "<IHHII", data, vernaux
                )
                needs.append((library, name_at(name_off)))
                vernaux += aux_next
            entry += nxt
    return needs


def newest_glibc(path):
    """The newest `GLIBC_x.y` version `path` needs, as (x, y); (2, 0) if it needs none."""
    versions = [(2, 0)]
    for _library, name in version_needs(path):
        m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", name)
        if m:
            versions.append((int(m.group(1)), int(m.group(2))))
    return max(versions)


def main(paths):
    if not paths:
        raise SystemExit(__doc__)
    newest = (2, 0)
    for path in paths:
        v = newest_glibc(path)
        print(f"{path} GLIBC_{v[0]}.{v[1]}")
        newest = max(newest, v)
    print(f"max {newest[0]}.{newest[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])

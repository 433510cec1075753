"""Writes and checks the kvc-router container image as an OCI image layout archive, by hand.

    python3 oci.py build --name NAME --tag TAG --out ARCHIVE BINARY...
    python3 oci.py check ARCHIVE --version VERSION

`build` makes one layer from nothing (`FROM scratch`): the binaries in /usr/local/bin, the
shared libraries they link and the dynamic loader (what `ldd` resolves for each, checked
against the ELF's own NEEDED entries and PT_INTERP), /etc/passwd and /etc/group with the
non-root user `kvc` (65532:65532) the image runs as, /etc/nsswitch.conf, and /tmp. The
entrypoint is the first binary. Every entry has a fixed owner and time (SOURCE_DATE_EPOCH,
else the last commit's time), so the same binaries give the same digests. The archive is an
OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/...`, the layer a tar.gz) with a
Docker `manifest.json` beside it, so `podman load` and `docker load` both take it.

`check` reads an archive back: every blob's digest and size against its descriptor, the
config (entrypoint, user, the layer's diff_id against the uncompressed layer), the Docker
manifest; unpacks the layer into a root filesystem, finds every library each binary needs
and its loader in it, and runs the binaries from it: `unshare -r chroot ROOTFS ... --version`
(as the image's user, `chroot --userspec=65532:65532`, where the check runs as root; the
rootfs's own loader with its libraries where chroot is refused), and the router serving from
the rootfs until it prints its listening line.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time

USER = ("kvc", 65532)
BIN_DIR = "usr/local/bin"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"


# --- ELF: what a binary needs of the system ---------------------------------------------------

def elf_needs(path):
    """(interpreter, [NEEDED library names]) of the 64-bit little-endian ELF at `path`."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise SystemExit(f"{path}: not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    interp = None
    for i in range(phnum):
        kind, _flags, offset, _va, _pa, filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if kind == 3:  # PT_INTERP
            interp = data[offset:offset + filesz].rstrip(b"\0").decode()
    sections = [
        struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)
    ]
    needed = []
    for _name, kind, _flags, _addr, offset, size, link, _info in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                needed.append(data[strtab + value:end].decode())
    return interp, needed


def resolved_libraries(binary):
    """The loader and every library `binary` loads, as paths on this machine (from `ldd`),
    after checking that they cover the ELF's own interpreter and NEEDED names."""
    out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    paths = {}
    for line in out.splitlines():
        line = line.strip()
        m = re.match(r"(\S+) => (/\S+) \(0x[0-9a-f]+\)$", line)
        if m:
            paths[m.group(1)] = m.group(2)
            continue
        m = re.match(r"(/\S+) \(0x[0-9a-f]+\)$", line)
        if m:
            paths[m.group(1)] = m.group(1)
            continue
        if line.startswith("linux-vdso.so") or "statically linked" in line:
            continue
        raise SystemExit(f"ldd {binary}: a line not understood: {line!r}")
    interp, needed = elf_needs(binary)
    # The loader is NEEDED by its name too (ld-linux-x86-64.so.2), which ldd shows as the path.
    names = set(paths) | {os.path.basename(p) for p in paths.values()}
    missing = [n for n in needed + [interp] if n not in names]
    if missing:
        raise SystemExit(f"{binary}: ldd resolved no path for {missing}")
    return sorted(set(paths.values()))


# --- the layer ----------------------------------------------------------------------------------

def source_date_epoch():
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "log", "-1", "--format=%ct"],
                             check=True, capture_output=True, text=True).stdout
        return int(out.strip())
    except (OSError, subprocess.CalledProcessError, ValueError):
        return 0


def layer_tar(binaries, mtime):
    """The root filesystem as tar bytes: entries sorted, owned by root, all at `mtime`."""
    name, uid = USER
    files = {
        "etc/passwd": (f"root:x:0:0:root:/root:/sbin/nologin\n"
                       f"{name}:x:{uid}:{uid}:kvc-router:/nonexistent:/sbin/nologin\n", 0o644),
        "etc/group": (f"root:x:0:\n{name}:x:{uid}:\n", 0o644),
        # glibc's own lookups (files then DNS: the pod's /etc/hosts and resolv.conf, which
        # the container runtime mounts), built into libc.so.6 since glibc 2.34.
        "etc/nsswitch.conf": ("passwd: files\ngroup: files\nhosts: files dns\n", 0o644),
    }
    contents = {path: (text.encode(), mode) for path, (text, mode) in files.items()}
    for binary in binaries:
        with open(binary, "rb") as f:
            contents[f"{BIN_DIR}/{os.path.basename(binary)}"] = (f.read(), 0o755)
    libraries = sorted({lib for b in binaries for lib in resolved_libraries(b)})
    for lib in libraries:
        real = os.path.realpath(lib)
        with open(real, "rb") as f:
            contents[lib.lstrip("/")] = (f.read(), os.stat(real).st_mode & 0o777)
    dirs = {"tmp": 0o1777}
    for path in contents:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.setdefault("/".join(parts[:i]), 0o755)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(set(dirs) | set(contents)):
            info = tarfile.TarInfo(path)
            info.mtime = mtime
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if path in dirs:
                info.type = tarfile.DIRTYPE
                info.mode = dirs[path]
                tar.addfile(info)
            else:
                data, mode = contents[path]
                info.mode = mode
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), libraries


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def build(args):
    mtime = source_date_epoch()
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mtime))
    layer, libraries = layer_tar(args.binaries, mtime)
    layer_gz = gzip.compress(layer, compresslevel=6, mtime=0)
    entrypoint = f"/{BIN_DIR}/{os.path.basename(args.binaries[0])}"
    ref = f"{args.name}:{args.tag}"
    config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": f"{USER[1]}:{USER[1]}",
            "Entrypoint": [entrypoint],
            "Env": ["PATH=/usr/local/bin"],
            "WorkingDir": "/",
            "Labels": {
                "org.opencontainers.image.title": args.name,
                "org.opencontainers.image.version": args.tag,
                "org.opencontainers.image.licenses": "Apache-2.0",
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [sha256(layer)]},
        "history": [{"created": created, "created_by": "scripts/image/build.sh"}],
    }
    config_bytes = canonical(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": sha256(config_bytes),
                   "size": len(config_bytes)},
        "layers": [{"mediaType": LAYER_TYPE, "digest": sha256(layer_gz),
                    "size": len(layer_gz)}],
        "annotations": {"org.opencontainers.image.created": created},
    }
    manifest_bytes = canonical(manifest)
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_TYPE,
        "manifests": [{
            "mediaType": MANIFEST_TYPE, "digest": sha256(manifest_bytes),
            "size": len(manifest_bytes),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"org.opencontainers.image.ref.name": ref},
        }],
    }
    blob = lambda digest: "blobs/sha256/" + digest.split(":", 1)[1]  # noqa: E731
    docker = [{
        "Config": blob(manifest["config"]["digest"]),
        "RepoTags": [ref],
        "Layers": [blob(manifest["layers"][0]["digest"])],
    }]
    entries = [
        ("oci-layout", canonical({"imageLayoutVersion": "1.0.0"})),
        ("index.json", canonical(index)),
        ("manifest.json", canonical(docker)),
        (blob(manifest["config"]["digest"]), config_bytes),
        (blob(manifest["layers"][0]["digest"]), layer_gz),
        (blob(index["manifests"][0]["digest"]), manifest_bytes),
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in ["blobs", "blobs/sha256"]:
            info = tarfile.TarInfo(path)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, mtime
            tar.addfile(info)
        for path, data in sorted(entries):
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, mtime
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, args.out)
    print(f"image {ref}: {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB; layer "
          f"{len(layer_gz) / 2**20:.1f} MiB gzip, {len(layer) / 2**20:.1f} MiB unpacked)")
    print(f"  manifest {index['manifests'][0]['digest']}")
    for b in args.binaries:
        print(f"  /{BIN_DIR}/{os.path.basename(b)}")
    for lib in libraries:
        print(f"  {lib}")


# --- check ---------------------------------------------------------------------------------------

def fail(msg):
    raise SystemExit(f"oci.py check: {msg}")


def expect(cond, msg):
    if not cond:
        fail(msg)


def read_blob(root, descriptor):
    digest = descriptor["digest"]
    path = os.path.join(root, "blobs", *digest.split(":", 1))
    with open(path, "rb") as f:
        data = f.read()
    expect(sha256(data) == digest, f"{path}: its sha256 is {sha256(data)}, not {digest}")
    expect(len(data) == descriptor["size"],
           f"{path}: {len(data)} bytes, its descriptor says {descriptor['size']}")
    return data


def rootfs_runner(rootfs):
    """How to run a binary of the root filesystem, and its name: chrooted as the image's user
    where this process may (root), else chrooted in a user namespace as its root, else
    (chroot refused) through the rootfs's own loader and libraries. The runner takes an argv
    whose first item is a path inside `rootfs` and gives the argv to run."""
    ways = [(["unshare", "-r", "chroot", rootfs], "unshare -r chroot")]
    if os.geteuid() == 0:
        user = f"{USER[1]}:{USER[1]}"
        ways.insert(0, (["chroot", f"--userspec={user}", rootfs], f"chroot --userspec={user}"))
    for prefix, how in ways:
        try:
            probe = subprocess.run(prefix + [f"/{BIN_DIR}/kvc-router", "--version"],
                                   capture_output=True, text=True)
        except OSError as e:
            print(f"  {how}: cannot run ({e})")
            continue
        if probe.returncode == 0:
            return (lambda argv, prefix=prefix: prefix + argv), f"{how} ROOTFS"
        print(f"  {how}: refused ({probe.stderr.strip()})")
    libdirs = ":".join(sorted({os.path.dirname(os.path.join(rootfs, p))
                               for p in lib_paths(rootfs)}))

    def through_loader(argv):
        binary = os.path.join(rootfs, argv[0].lstrip("/"))
        interp, _ = elf_needs(binary)
        return [os.path.join(rootfs, interp.lstrip("/")), "--library-path", libdirs, binary,
                *argv[1:]]
    return through_loader, "ROOTFS/<loader> --library-path ROOTFS/<lib dirs> ROOTFS"


def lib_paths(rootfs):
    out = []
    for d, _dirs, files in os.walk(rootfs):
        rel = os.path.relpath(d, rootfs)
        if rel.split("/")[0] in ("lib", "lib64", "usr") and rel != BIN_DIR:
            out += [os.path.join(rel, f) for f in files if ".so" in f]
    return out


def check(args):
    work = tempfile.mkdtemp(prefix="kvc-oci-")
    try:
        layout = os.path.join(work, "layout")
        with tarfile.open(args.archive) as tar:
            extract_all(tar, layout, "data")
        with open(os.path.join(layout, "oci-layout")) as f:
            expect(json.load(f) == {"imageLayoutVersion": "1.0.0"}, "oci-layout")
        with open(os.path.join(layout, "index.json")) as f:
            index = json.load(f)
        expect(index["schemaVersion"] == 2 and len(index["manifests"]) == 1,
               f"index.json: {index}")
        desc = index["manifests"][0]
        expect(desc["mediaType"] == MANIFEST_TYPE, f"index.json: {desc}")
        ref = desc["annotations"]["org.opencontainers.image.ref.name"]
        manifest = json.loads(read_blob(layout, desc))
        expect(manifest["config"]["mediaType"] == CONFIG_TYPE, f"manifest: {manifest}")
        expect(len(manifest["layers"]) == 1 and manifest["layers"][0]["mediaType"] == LAYER_TYPE,
               f"manifest: {manifest}")
        config = json.loads(read_blob(layout, manifest["config"]))
        layer_gz = read_blob(layout, manifest["layers"][0])
        layer = gzip.decompress(layer_gz)
        expect(config["rootfs"] == {"type": "layers", "diff_ids": [sha256(layer)]},
               f"config rootfs {config['rootfs']} is not the layer's {sha256(layer)}")
        expect((config["os"], config["architecture"]) == ("linux", "amd64"), "platform")
        c = config["config"]
        entry = f"/{BIN_DIR}/kvc-router"
        expect(c["Entrypoint"] == [entry], f"entrypoint {c['Entrypoint']}")
        user = f"{USER[1]}:{USER[1]}"
        expect(c["User"] == user, f"user {c.get('User')}, not {user}")
        with open(os.path.join(layout, "manifest.json")) as f:
            docker = json.load(f)
        blob = lambda d: "blobs/sha256/" + d["digest"].split(":", 1)[1]  # noqa: E731
        expect(docker == [{"Config": blob(manifest["config"]), "RepoTags": [ref],
                           "Layers": [blob(manifest["layers"][0])]}],
               f"manifest.json: {docker}")
        print(f"  {ref}: digests, sizes, entrypoint {entry}, user {user} as stated")

        rootfs = os.path.join(work, "rootfs")
        with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
            members = tar.getmembers()
            expect(all(m.uid == 0 and m.gid == 0 for m in members), "an entry not owned by root")
            extract_all(tar, rootfs, "tar")
        with open(os.path.join(rootfs, "etc/passwd")) as f:
            expect(f"{USER[0]}:x:{USER[1]}:{USER[1]}:" in f.read(), "no kvc user in /etc/passwd")
        binaries = sorted(os.listdir(os.path.join(rootfs, BIN_DIR)))
        expect(binaries == ["kvc-replay", "kvc-router"], f"/{BIN_DIR}: {binaries}")
        # Every library each binary needs, found where the loader looks, and the loader.
        libs = {os.path.basename(p) for p in lib_paths(rootfs)}
        for b in binaries:
            interp, needed = elf_needs(os.path.join(rootfs, BIN_DIR, b))
            expect(os.path.isfile(os.path.join(rootfs, interp.lstrip("/"))),
                   f"{b}: its loader {interp} is not in the image")
            missing = [n for n in needed if n not in libs]
            expect(not missing, f"{b}: {missing} not in the image")
        print(f"  rootfs: {len(members)} entries; the binaries' libraries: {sorted(libs)}")

        runner, how = rootfs_runner(rootfs)
        for b in binaries:
            out = subprocess.run(runner([f"/{BIN_DIR}/{b}", "--version"]), capture_output=True, text=True, timeout=60)
            want = f"{b} {args.version}\n"
            expect(out.returncode == 0 and out.stdout == want,
                   f"{b} --version from the rootfs ({how}): {out.returncode} "
                   f"{out.stdout!r} {out.stderr!r}, not {want!r}")
            print(f"  {how}/{BIN_DIR}/{b} --version: {out.stdout.strip()}")
        # The router serving from the rootfs: it prints its listening line once bound.
        argv = runner([entry, "--listen", "127.0.0.1:0", "--no-metrics", "--log", "warn"])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = read_line_within(proc, 30)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        expect(line.startswith("kvc-router grpc=127.0.0.1:"),
               f"the router from the rootfs printed {line!r}: {proc.stderr.read()!r}")
        print(f"  {how}{entry} --listen 127.0.0.1:0: {line.strip()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"image check passed: {args.archive}")


def extract_all(tar, dest, kind):
    """`tar` unpacked into `dest` with the named extraction filter where Python has them."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter=kind)
    else:
        tar.extractall(dest)


def read_line_within(proc, seconds):
    """The first line `proc` prints, waiting at most `seconds` for it."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sel.select(timeout=max(0.0, deadline - time.monotonic())):
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    return ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--name", required=True)
    b.add_argument("--tag", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("binaries", nargs="+")
    c = sub.add_parser("check")
    c.add_argument("archive")
    c.add_argument("--version", required=True)
    args = parser.parse_args()
    build(args) if args.command == "build" else check(args)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Builds the node's binary wheel: `pip install cyberwave-cloud-node` puts the static binary on
PATH (as ruff and uv ship theirs) and installs the thin Python module `cyberwave_cloud_node`
(the documented `CloudNode` / `CloudNodeConfig` API, which runs the binary).

    packaging/build-wheel.py [--bin PATH] [--channel stable|staging|dev] [--build N] [--out DIR]

Written with the standard library rather than maturin: maturin builds the binary itself, with
its own cargo invocation, and the wheel must carry exactly the static binary that the .debs and
the image ship (packaging/build-static.sh), byte for byte. The binary is fully static, so one
wheel serves glibc and musl hosts alike: it is tagged manylinux2014 and musllinux_1_1.

Versions follow the channels as PEP 440 releases: stable `X.Y.Z`, staging `X.Y.ZrcN`,
dev `X.Y.Z.devN` (N = --build, default 0), so `pip install --pre` takes the newest channel build
and a plain `pip install` only stable ones.
"""

import argparse
import base64
import hashlib
import os
import re
import stat
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = "cyberwave_cloud_node"
TAG = "py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.musllinux_1_1_x86_64"


def cargo_version() -> str:
    text = (ROOT / "Cargo.toml").read_text()
    m = re.search(r'^version = "([^"]+)"', text, re.M)
    if not m:
        sys.exit("no version in Cargo.toml")
    return m.group(1)


def pep440(version: str, channel: str, build: int) -> str:
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        sys.exit(f"Cargo.toml version {version!r} is not X.Y.Z")
    return {"stable": version, "staging": f"{version}rc{build}", "dev": f"{version}.dev{build}"}[channel]


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(ROOT / "target/static/cyberwave-cloud-node"))
    ap.add_argument("--channel", choices=["stable", "staging", "dev"], default="stable")
    ap.add_argument("--build", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "target/wheels"))
    ap.add_argument("--stored", action="store_true", help="no compression (tests: seconds, not a minute)")
    a = ap.parse_args()
    if a.build < 0:
        sys.exit("--build must be ≥ 0")
    binary = Path(a.bin)
    if not binary.is_file():
        sys.exit(f"{binary}: no binary (run packaging/build-static.sh first)")
    version = pep440(cargo_version(), a.channel, a.build)
    readme = (ROOT / "packaging/wheel-README.md").read_text()
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        "Name: cyberwave-cloud-node",
        f"Version: {version}",
        "Summary: Cyberwave cloud node: turns a GPU host into a worker of the Cyberwave platform",
        "Home-page: https://github.com/cyberwave-os/cyberwave-cloud-node",
        "License: see the licence files in the .deb (the binary links Eclipse Paho C, EPL-2.0)",
        "Requires-Python: >=3.8",
        "Classifier: Operating System :: POSIX :: Linux",
        "Classifier: Programming Language :: Rust",
        "Description-Content-Type: text/markdown",
        "",
        readme,
    ])
    wheel = "\n".join(["Wheel-Version: 1.0", "Generator: cyberwave-cloud-node packaging/build-wheel.py",
                       "Root-Is-Purelib: false", f"Tag: {TAG}", ""])
    info = f"{DIST}-{version}.dist-info"
    data = f"{DIST}-{version}.data"
    files = []
    for src in sorted((ROOT / "python" / DIST).glob("*.py")):
        text = src.read_text().replace("@VERSION@", version)
        files.append((f"{DIST}/{src.name}", text.encode(), 0o644))
    files.append((f"{data}/scripts/cyberwave-cloud-node", binary.read_bytes(), 0o755))
    files.append((f"{info}/METADATA", metadata.encode(), 0o644))
    files.append((f"{info}/WHEEL", wheel.encode(), 0o644))
    record = "".join(f"{name},{digest(body)},{len(body)}\n" for name, body, _ in files)
    record += f"{info}/RECORD,,\n"
    files.append((f"{info}/RECORD", record.encode(), 0o644))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{DIST}-{version}-{TAG}.whl"
    method = zipfile.ZIP_STORED if a.stored else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w", compression=method) as z:
        for name, body, mode in files:
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = (stat.S_IFREG | mode) << 16
            zi.compress_type = method
            z.writestr(zi, body)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

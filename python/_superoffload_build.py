"""Build step of the superoffload wheel (setuptools command classes, wired in by pyproject.toml).

- `VERSION`: the crate's version from Cargo.toml (the package's version; the library reports the
  same string through so_version_string()).
- `BuildPy`: after the Python sources, builds the library with
  `cargo build --release --lib --locked` (debug info stripped: CARGO_PROFILE_RELEASE_STRIP) and
  copies it into the package under its SONAME, read from the library (`libsuperoffload.so.0.<minor>`
  while the major version is 0; so a C++ extension linked against it finds it by that name), with
  the C and C++ headers under `include/`.
  SUPEROFFLOAD_PREBUILT_LIBRARY=<path> copies that library instead of running cargo;
  CARGO_TARGET_DIR and CARGO are honoured.
- `BdistWheel`: the wheel is platform-specific but independent of the Python version and ABI
  (the Python layer reaches the library through ctypes): tag py3-none-<platform>.

Not shipped in the wheel (it is not in the package list).
"""
import os
import re
import shutil
import struct
import subprocess
import sys

from setuptools.command.build import build as _build
from setuptools.command.build_py import build_py as _build_py

try:  # setuptools >= 70.1 ships bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # pragma: no cover - older setuptools
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cargo_version():
    with open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8") as f:
        text = f.read()
    package = text.split("[package]", 1)[1].split("\n[", 1)[0]
    m = re.search(r'^version\s*=\s*"([^"]+)"', package, re.M)
    if not m:
        raise RuntimeError("no version in Cargo.toml's [package] section")
    return m.group(1)


VERSION = _cargo_version()


def _log(msg):
    print(f"superoffload build: {msg}", file=sys.stderr, flush=True)


def build_library():
    """Builds (or takes) the shared library; returns its path."""
    pre = os.environ.get("SUPEROFFLOAD_PREBUILT_LIBRARY")
    if pre:
        if not os.path.isfile(pre):
            raise RuntimeError(f"SUPEROFFLOAD_PREBUILT_LIBRARY={pre} is not a file")
        _log(f"using the prebuilt library {pre}")
        return pre
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if not cargo:
        raise RuntimeError(
            "building superoffload from source needs a Rust toolchain (cargo on PATH; https://rustup.rs), "
            "or SUPEROFFLOAD_PREBUILT_LIBRARY=<path to libsuperoffload.so>; to install without Rust, "
            "install a built wheel instead")
    env = dict(os.environ)
    env.setdefault("CARGO_PROFILE_RELEASE_STRIP", "debuginfo")
    target = env.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    cmd = [cargo, "build", "--release", "--lib", "--locked", "--manifest-path", os.path.join(ROOT, "Cargo.toml")]
    _log(" ".join(cmd) + f" (target dir {target}; takes a few minutes)")
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    path = os.path.join(target, "release", "libsuperoffload.so")
    if not os.path.isfile(path):
        raise RuntimeError(f"cargo did not produce {path}")
    return path


def soname(path):
    """The SONAME (DT_SONAME) of a 64-bit little-endian ELF shared library: build.rs sets it."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        raise RuntimeError(f"{path} is not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Section headers: (name, type, flags, addr, offset, size, link, info, addralign, entsize).
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _, sh_type, _, _, offset, size, link, *_ in sections:
        if sh_type != 6:  # SHT_DYNAMIC; its sh_link is the section of its strings
            continue
        strings = sections[link][4]
        for pos in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 14:  # DT_SONAME
                start = strings + value
                return data[start:data.index(b"\0", start)].decode()
    raise RuntimeError(f"{path} has no SONAME")


class Build(_build):
    """Builds under target/python-build (build/ is the CMake build directory of this repository)."""

    def initialize_options(self):
        super().initialize_options()
        self.build_base = os.path.join("target", "python-build")


class BuildPy(_build_py):
    """build_py + the library and headers."""

    def run(self):
        super().run()
        if self.dry_run:
            return
        pkg = os.path.join(self.build_lib, "superoffload")
        for old in os.listdir(pkg):
            if old.startswith("libsuperoffload.so"):
                os.remove(os.path.join(pkg, old))
        library = build_library()
        installed = os.path.join(pkg, soname(library))
        shutil.copyfile(library, installed)
        os.chmod(installed, 0o755)
        include = os.path.join(pkg, "include")
        shutil.rmtree(include, ignore_errors=True)
        # The C header, the C++ umbrella header and its topic headers (include/superoffload/).
        shutil.copytree(os.path.join(ROOT, "include"), include)


class BdistWheel(_bdist_wheel):
    """Platform wheel, any Python 3: py3-none-<platform>."""

    def finalize_options(self):
        # The package carries a native library: a platlib (non-pure) wheel.
        self.distribution.has_ext_modules = lambda: True
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat

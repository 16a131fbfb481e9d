"""Builds (once, then cached) and imports the C++ extension `superoffload_torch.cpp` against an
installed superoffload prefix: headers in <prefix>/include, <prefix>/lib/libsuperoffload.so,
linked with -Wl,-rpath to that directory.

The prefix comes from the `prefix` argument, else $SUPEROFFLOAD_PREFIX. The build uses
torch.utils.cpp_extension.load (JIT, ninja) when ninja is available, otherwise g++ directly with
the same flags (no ninja or setuptools needed). For a CUDA build of torch, the CUDA headers that
<ATen/cuda/CUDAContext.h> needs are looked up in $CUDA_HOME/include, /usr/local/cuda/include and
the nvidia-* wheels next to torch (site-packages/nvidia/*/include; crt/ also in triton's copy of
the CUDA headers, as the runtime wheels lack it); without them the extension is
compiled with SO_TORCH_CUDA=0 and CUDA sessions get their streams from Python instead.

Environment: SUPEROFFLOAD_PREFIX, SO_TORCH_BUILD_DIR (default: build/ next to the package),
SO_TORCH_BUILDER=auto|ninja|gxx, SO_TORCH_NO_CUDA_HEADERS=1 (force SO_TORCH_CUDA=0),
SO_TORCH_VERBOSE=1, CXX.
"""
import glob
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(os.path.dirname(HERE), "superoffload_torch.cpp")
_CUDA_HEADERS = ("cuda_runtime_api.h", "crt/host_defines.h", "cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h")
_loaded = {}


class BuildError(RuntimeError):
    pass


def find_prefix(prefix=None):
    prefix = prefix or os.environ.get("SUPEROFFLOAD_PREFIX")
    if not prefix:
        raise BuildError("superoffload_torch: no superoffload install prefix: pass prefix=... or set "
                         "SUPEROFFLOAD_PREFIX (cmake --install <build> --prefix <prefix>)")
    prefix = os.path.abspath(prefix)
    for rel in ("include/superoffload.h", "include/superoffload.hpp", "lib/libsuperoffload.so"):
        if not os.path.exists(os.path.join(prefix, rel)):
            raise BuildError(f"superoffload_torch: {prefix} is not a superoffload install prefix: {rel} is missing")
    return prefix


def cuda_include_dirs():
    """Directories that together hold the CUDA headers torch's CUDA headers include, or (None, why)."""
    import torch
    site = os.path.dirname(os.path.dirname(torch.__file__))
    cands = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "include"))
    # The nvidia-* wheels torch was built against first (nvidia/cu13/ for CUDA 13 wheels), then
    # any other; they lack crt/ (it comes with nvcc), which triton, a dependency of CUDA torch
    # wheels, ships a copy of; a system toolkit last (its version may differ from torch's).
    major = (torch.version.cuda or "").split(".")[0]
    wheels = sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
    cands += sorted(wheels, key=lambda d: os.path.basename(os.path.dirname(d)) != f"cu{major}")
    cands += [os.path.join(site, "triton", "backends", "nvidia", "include"), "/usr/local/cuda/include"]
    dirs, found = [], set()
    for d in cands:
        have = [h for h in _CUDA_HEADERS if os.path.exists(os.path.join(d, h))]
        if have and d not in dirs and not set(have) <= found:
            dirs.append(d)
            found |= set(have)
    missing = [h for h in _CUDA_HEADERS if h not in found]
    if missing:
        return None, f"CUDA headers not found: {', '.join(missing)} (looked in {', '.join(cands) or 'nothing'})"
    return dirs, ""


def _cxx_std(cxx):
    """The standard torch.utils.cpp_extension compiles with (torch 2.11: C++17, 2.15: C++20),
    if the compiler has it."""
    import re
    from torch.utils import cpp_extension
    try:
        with open(cpp_extension.__file__) as f:
            m = re.search(r"-std=(c\+\+\d\d)", f.read())
        prefs = [m.group(1)] if m else []
    except OSError:
        prefs = []
    for std in prefs + ["c++20", "c++17"]:
        r = subprocess.run([cxx, f"-std={std}", "-x", "c++", "-fsyntax-only", "-"], input=b"int main(){}",
                           capture_output=True)
        if r.returncode == 0:
            return std
    return "c++17"


def load(prefix=None, verbose=None, force_rebuild=False):
    """The extension module (built on first use). Raises BuildError with the compiler's output."""
    import torch
    prefix = find_prefix(prefix)
    verbose = bool(int(os.environ.get("SO_TORCH_VERBOSE", "0"))) if verbose is None else verbose
    with_cuda, why = False, "torch has no CUDA"
    inc_cuda = []
    if torch.version.cuda:
        if os.environ.get("SO_TORCH_NO_CUDA_HEADERS") == "1":
            why = "SO_TORCH_NO_CUDA_HEADERS=1"
        else:
            dirs, why = cuda_include_dirs()
            if dirs:
                with_cuda, inc_cuda = True, dirs
    key = (prefix, with_cuda)
    if key in _loaded and not force_rebuild:
        return _loaded[key]
    try:
        mod = _load(prefix, with_cuda, inc_cuda, why, verbose, force_rebuild)
    except BuildError as e:
        if not with_cuda:
            raise
        # The CUDA headers found do not compile with this torch: build without them (CUDA
        # sessions then take their streams from Python), loudly.
        print(f"superoffload_torch: WARNING: the build with CUDA headers ({', '.join(inc_cuda)}) failed; "
              f"building without them (SO_TORCH_CUDA=0). The error was:\n{str(e)[-3000:]}", file=sys.stderr)
        mod = _load(prefix, False, [], "the build with CUDA headers failed", verbose, force_rebuild)
    _loaded[key] = mod
    return mod


def _load(prefix, with_cuda, inc_cuda, why, verbose, force_rebuild):
    import torch

    lib_dir = os.path.join(prefix, "lib")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    digest = hashlib.sha1()
    for part in (open(SOURCE, "rb").read(), open(os.path.join(prefix, "include/superoffload.h"), "rb").read(),
                 open(os.path.join(prefix, "include/superoffload.hpp"), "rb").read(),
                 torch.__version__.encode(), prefix.encode(), str(with_cuda).encode(), sys.version.encode(),
                 "\0".join(inc_cuda).encode()):
        digest.update(part)
    name = f"superoffload_torch_ext_{digest.hexdigest()[:10]}"
    build_root = os.environ.get("SO_TORCH_BUILD_DIR") or os.path.join(os.path.dirname(HERE), "build")
    build_dir = os.path.join(build_root, name)
    os.makedirs(build_dir, exist_ok=True)

    cflags = ["-O2", f"-DSO_TORCH_CUDA={1 if with_cuda else 0}", "-Wall", "-Wno-unused-function"]
    ldflags = [f"-L{lib_dir}", "-lsuperoffload", f"-Wl,-rpath,{lib_dir}"]
    if with_cuda:
        ldflags += [f"-L{torch_lib}", "-lc10_cuda"]
    includes = [os.path.join(prefix, "include")] + inc_cuda
    if verbose or not with_cuda:
        print(f"superoffload_torch: building {name} against {prefix} "
              f"({'with CUDA headers ' + ', '.join(inc_cuda) if with_cuda else 'without CUDA headers: ' + why})",
              file=sys.stderr)

    builder = os.environ.get("SO_TORCH_BUILDER", "auto")
    venv_bin = os.path.dirname(sys.executable)
    if builder in ("auto", "ninja") and shutil.which("ninja") is None and os.path.exists(os.path.join(venv_bin, "ninja")):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension
    use_ninja = builder == "ninja" or (builder == "auto" and cpp_extension.is_ninja_available())
    try:
        if use_ninja:
            mod = cpp_extension.load(name=name, sources=[SOURCE], extra_cflags=cflags, extra_ldflags=ldflags,
                                     extra_include_paths=includes, build_directory=build_dir, with_cuda=False,
                                     verbose=verbose)
        else:
            mod = _build_gxx(name, build_dir, cflags, ldflags, includes, verbose, force_rebuild)
    except BuildError:
        raise
    except Exception as e:  # cpp_extension raises RuntimeError with the compiler output
        raise BuildError(f"superoffload_torch: building the extension failed ({'ninja' if use_ninja else 'g++'}, "
                         f"build dir {build_dir}):\n{e}") from e
    mod.build_info = {"name": name, "prefix": prefix, "cuda_headers": with_cuda,
                      "why_no_cuda_headers": "" if with_cuda else why, "cuda_include_dirs": inc_cuda,
                      "builder": "ninja" if use_ninja else "g++", "build_dir": build_dir}
    return mod


def _build_gxx(name, build_dir, cflags, ldflags, includes, verbose, force_rebuild):
    """The same compile and link torch.utils.cpp_extension.load does, without ninja."""
    import torch
    from torch.utils import cpp_extension
    out = os.path.join(build_dir, name + sysconfig.get_config_var("EXT_SUFFIX"))
    if force_rebuild or not os.path.exists(out):
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            raise BuildError(f"superoffload_torch: no C++ compiler ({cxx!r} is not on PATH; set CXX)")
        py_inc = sysconfig.get_path("include", scheme="posix_prefix")
        cmd = [cxx, "-shared", "-fPIC", f"-std={_cxx_std(cxx)}", f"-DTORCH_EXTENSION_NAME={name}",
               "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
        abi_flags = getattr(cpp_extension, "_get_pybind11_abi_build_flags", None)
        if abi_flags is not None:
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cmd += list(abi_flags())
        cmd += [f"-I{d}" for d in includes]
        for d in cpp_extension.include_paths() + [py_inc]:
            cmd += ["-isystem", d]
        cmd += cflags + [SOURCE, "-o", out + ".tmp"]
        cmd += ldflags + [f"-L{os.path.dirname(torch.__file__)}/lib", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
        if verbose:
            print("superoffload_torch:", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"superoffload_torch: compiling {SOURCE} failed (exit {r.returncode}):\n"
                             f"{' '.join(shlex.quote(c) for c in cmd)}\n{r.stdout}{r.stderr}")
        os.replace(out + ".tmp", out)
    spec = importlib.util.spec_from_file_location(name, out, loader=importlib.machinery.ExtensionFileLoader(name, out))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

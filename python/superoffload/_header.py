"""A parser for the cbindgen-generated `superoffload.h`, and the check that the ctypes mirrors in
`superoffload._abi` match it (enums, structs and functions: names, order, types).

    python -m superoffload._header [path/to/superoffload.h]    # exit 1 on a mismatch

Without a path it checks the header shipped in the package (`superoffload/include/`) or, in a
checkout, `include/superoffload.h`. Pure Python, no torch, no library load needed.
"""
import ctypes as C
import os
import re
import sys

_SCALARS = {
    "size_t": C.c_size_t, "uint8_t": C.c_uint8, "uint32_t": C.c_uint32, "uint64_t": C.c_uint64,
    "int32_t": C.c_int32, "int64_t": C.c_int64, "double": C.c_double, "float": C.c_float, "bool": C.c_bool,
    "int": C.c_int, "char": C.c_char,
}


# Types the header names but other headers define (CUDA's stream, XLA's FFI call frame and error):
# only ever behind pointers.
_FOREIGN_OPAQUE = ("CUstream_st", "XLA_FFI_CallFrame", "XLA_FFI_Error")


def _strip(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def parse(text):
    """{"enums": {name: [(constant, value)]}, "structs": {name: [(field, ctype text)]},
    "opaque": {names}, "typedefs": {name: ctype text}, "functions": {name: (ret, [arg types])}}."""
    src = _strip(text)
    enums = {}
    for m in re.finditer(r"\benum\s+(\w+)\s*(?::\s*\w+\s*)?\{(.*?)\}\s*;", src, re.S):
        items = []
        for part in m.group(2).split(","):
            part = part.strip()
            if not part:
                continue
            name, _, value = part.partition("=")
            items.append((name.strip(), int(value.strip(), 0)))
        enums[m.group(1)] = items
    structs = {}
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", src, re.S):
        fields = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            first, *more = [d.strip() for d in decl.split(",")]  # "double a, b, c" declares three
            fm = re.match(r"(.*?)(\w+)$", first)
            base = fm.group(1)
            fields.append((fm.group(2), " ".join(base.replace("*", " * ").split())))
            for d in more:
                stars, name = re.match(r"(\**)\s*(\w+)$", d).groups()
                fields.append((name, " ".join((base.replace("*", "") + " *" * len(stars)).split())))
        structs[m.group(1)] = fields
    opaque = set(re.findall(r"typedef\s+struct\s+(\w+)\s+\1\s*;", src))
    typedefs = {}
    for m in re.finditer(r"typedef\s+([\w\s\*]+?)\s*\b(\w+)\s*;", src):
        if m.group(1).startswith("struct") and m.group(1).split()[-1] == m.group(2):
            continue
        if m.group(1).startswith("enum"):
            continue
        typedefs[m.group(2)] = " ".join(m.group(1).replace("*", " * ").split())
    functions = {}
    body = re.sub(r"\bSO_NODISCARD\b", " ", src)
    body = re.sub(r"typedef[^;]*;", " ", body)
    body = re.sub(r"\benum\s+\w+\s*(?::\s*\w+\s*)?\{.*?\}\s*;", " ", body, flags=re.S)
    body = re.sub(r'extern\s+"C"\s*\{', " ", body)
    for m in re.finditer(r"([\w\s\*]+?)\b(so_\w+)\s*\(([^;{]*?)\)\s*;", body, re.S):
        ret = " ".join(m.group(1).replace("*", " * ").split())
        args = []
        raw = " ".join(m.group(3).split())
        ok = True
        if raw and raw != "void":
            for a in raw.split(","):
                am = re.match(r"([\w\s\*]*?[\s\*])(\w+)$", a.strip())
                if am is None:  # not a declaration (C++ code in a source file)
                    ok = False
                    break
                args.append(" ".join(am.group(1).replace("*", " * ").split()))
        if ok:
            functions[m.group(2)] = (ret, args)
    return {"enums": enums, "structs": structs, "opaque": opaque, "typedefs": typedefs, "functions": functions}


def ctype_of(text, parsed, mirrors):
    """The ctypes type a C type (as the header spells it) must be mirrored by."""
    words = [w for w in text.split() if w != "const"]
    stars = words.count("*")
    words = [w for w in words if w != "*"]
    base = " ".join(words)
    if base.startswith("struct "):
        base = base[len("struct "):]
    if stars == 0:
        if base in _SCALARS:
            return _SCALARS[base]
        if base in parsed["typedefs"]:
            return ctype_of(parsed["typedefs"][base], parsed, mirrors)
        if base in parsed["enums"] or base == "so_status":
            return C.c_uint32
        if base in parsed["structs"]:
            return mirrors[base]
        if base == "void":
            return None
        raise KeyError(f"no ctypes mapping for C type {text!r}")
    # pointers
    if stars == 1 and base == "void":
        return C.c_void_p
    if stars == 1 and base == "char":
        return C.c_char_p
    if base in parsed["opaque"] or base in _FOREIGN_OPAQUE:
        inner = C.c_void_p
        stars -= 1
    elif base == "void":
        inner = C.c_void_p
        stars -= 1
    else:
        inner = ctype_of(base, parsed, mirrors)
    for _ in range(stars):
        inner = C.POINTER(inner)
    return inner


def _tname(t):
    if t is None:
        return "void"
    return getattr(t, "__name__", repr(t))


def compare(parsed, abi):
    """Differences between the header and the mirrors in `abi` (a list of strings; empty: none)."""
    problems = []
    # enums
    for cname, items in parsed["enums"].items():
        cls = abi.ENUMS.get(cname)
        if cls is None:
            problems.append(f"enum {cname}: no mirror in superoffload._abi.ENUMS")
            continue
        prefix = cname.upper() + "_"
        mine = [(prefix + m.name, int(m.value)) for m in cls]
        if mine != items:
            problems.append(f"enum {cname}: header {items} != mirror {mine}")
    for cname in abi.ENUMS:
        if cname not in parsed["enums"]:
            problems.append(f"enum {cname}: mirrored but not in the header")
    # structs
    for cname, fields in parsed["structs"].items():
        cls = abi.STRUCTS.get(cname)
        if cls is None:
            problems.append(f"struct {cname}: no mirror in superoffload._abi.STRUCTS")
            continue
        want = [(n, ctype_of(t, parsed, abi.STRUCTS)) for n, t in fields]
        have = list(cls._fields_)
        if [n for n, _ in want] != [n for n, _ in have]:
            problems.append(f"struct {cname}: fields {[n for n, _ in want]} in the header, "
                            f"{[n for n, _ in have]} in the mirror")
            continue
        for (n, wt), (_, ht) in zip(want, have):
            if wt is not ht:
                problems.append(f"struct {cname}.{n}: header type {_tname(wt)}, mirror {_tname(ht)}")
    for cname in abi.STRUCTS:
        if cname not in parsed["structs"]:
            problems.append(f"struct {cname}: mirrored but not in the header")
    # functions
    for fname, (ret, args) in parsed["functions"].items():
        proto = abi.FUNCTIONS.get(fname)
        if proto is None:
            problems.append(f"function {fname}: no prototype in superoffload._abi.FUNCTIONS")
            continue
        want_ret = ctype_of(ret, parsed, abi.STRUCTS)
        want_args = [ctype_of(a, parsed, abi.STRUCTS) for a in args]
        if want_ret is not proto[0]:
            problems.append(f"function {fname}: returns {_tname(want_ret)} in the header, {_tname(proto[0])} in the mirror")
        if len(want_args) != len(proto[1]) or any(a is not b for a, b in zip(want_args, proto[1])):
            problems.append(f"function {fname}: arguments ({', '.join(map(_tname, want_args))}) in the header, "
                            f"({', '.join(map(_tname, proto[1]))}) in the mirror")
    for fname in abi.FUNCTIONS:
        if fname not in parsed["functions"]:
            problems.append(f"function {fname}: mirrored but not in the header")
    return problems


def compare_structs(parsed, mirrors):
    """Differences between the structs of a parsed C source and ctypes mirrors {C name: class}
    (for other C ABIs, such as an example's own structs)."""
    problems = []
    for cname, cls in mirrors.items():
        if cname not in parsed["structs"]:
            problems.append(f"struct {cname}: not in the source")
            continue
        want = [(n, ctype_of(t, parsed, mirrors)) for n, t in parsed["structs"][cname]]
        have = list(cls._fields_)
        if [n for n, _ in want] != [n for n, _ in have]:
            problems.append(f"struct {cname}: fields {[n for n, _ in want]} in the source, {[n for n, _ in have]} "
                            "in the mirror")
            continue
        for (n, wt), (_, ht) in zip(want, have):
            if wt is not ht:
                problems.append(f"struct {cname}.{n}: source type {_tname(wt)}, mirror {_tname(ht)}")
    return problems


_LIMITS = {"UINT32_MAX": (1 << 32) - 1, "UINT64_MAX": (1 << 64) - 1}


def defines(text):
    """{name: value} of the header's `#define SO_...` integer constants (literals and stdint limits)."""
    out = {}
    for m in re.finditer(r"^#define\s+(SO_\w+)\s+(\w+)\s*$", text, re.M):
        value = m.group(2)
        if value in _LIMITS:
            out[m.group(1)] = _LIMITS[value]
        elif value.isdigit():
            out[m.group(1)] = int(value)
    return out


def compare_constants(text, constants):
    """Differences between the header's constants and the mirrored ones ({name: value})."""
    found = defines(text)
    return [f"constant {name}: {found.get(name)} in the header, {value} in the mirror"
            for name, value in constants.items() if found.get(name) != value]


def header_abi_version(text):
    m = re.search(r"#define\s+SO_ABI_VERSION\s+(\d+)", text)
    return int(m.group(1)) if m else None


def default_header():
    here = os.path.dirname(os.path.abspath(__file__))
    for p in (os.path.join(here, "include", "superoffload.h"),
              os.path.join(os.path.dirname(os.path.dirname(here)), "include", "superoffload.h")):
        if os.path.isfile(p):
            return p
    raise FileNotFoundError("no superoffload.h in the package or the checkout")


def check(path=None):
    """Returns the list of differences between the header at `path` and the mirrors."""
    from . import _abi
    with open(path or default_header(), encoding="utf-8") as f:
        text = f.read()
    problems = compare(parse(text), _abi) + compare_constants(text, _abi.CONSTANTS)
    v = header_abi_version(text)
    if v != _abi.ABI_VERSION:
        problems.append(f"SO_ABI_VERSION is {v} in the header, {_abi.ABI_VERSION} in the mirror")
    return problems


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else default_header()
    problems = check(path)
    for p in problems:
        print("MISMATCH:", p)
    print(f"{path}: {'mirrors match' if not problems else f'{len(problems)} mismatch(es)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The CuPy stand-in (tests/standin) against CuPy itself, so that no name or call that works
on the stand-in fails only on a GPU: every public name the stand-in defines (cupy, cupy.cuda
and cupy.cuda.runtime, cupyx, the members of their classes, the attributes their objects
carry, and the private classes whose objects zmpi gets: the memory pool, memory pointers, the
ufuncs) exists in CuPy at the same dotted path, as the same kind of thing (a module, something
called, or a value or property: a property that CuPy makes a method reads as always true),
plain values of the same type; and every call a stand-in callable accepts, CuPy's accepts and
reads alike: the same positional parameter at each position, the keywords, none optional in
the stand-in but required in CuPy, the same defaults.

CuPy is cupy-cuda13x 14.2.0, the GPU machines' (the API is cupy-cuda12x 14.2's too), which
`make install` puts with cuda-pathfinder (what `import cupy` needs besides NumPy) into
$(VENV)/real-cupy, off the venv's sys.path: this suite and zmpi.backend still see no CuPy.
Importing it needs no GPU and no CUDA library. A child process describes each side (the
stand-in's, and CuPy's with real-cupy first on sys.path); this process compares them.
CuPy's signatures come from `inspect.signature`, else from the signature line that Cython
writes at the head of a docstring (`MemoryPool.malloc(self, size_t size)`, the C types
dropped); what has neither is listed in a warning, not failed.

What zmpi calls in CuPy that the stand-in lacks (cuBLAS's gemmStridedBatchedEx and its
enums, get_cublas_handle, RawModule, get_function and kernel launches: the CUDA launchers run
on tests/cuda_cpu.py instead), test_zmpi_calls_cupy_where_the_standin_does_not_reach holds
to CuPy's signatures call site by call site. What neither can see: behaviour (what a call
returns or does with its arguments), what the stand-in passes on (`*args`: noted, not
compared), and the argument types a Cython signature declares (`size_t size`).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
STANDIN_DIR = REPO_ROOT / "tests" / "standin"
CUPY_VERSION = "14.2.0"  # the Makefile's REAL_CUPY_VERSION
REAL_CUPY = Path(os.environ.get("ZMPI_REAL_CUPY", Path(sys.prefix) / "real-cupy"))

# The stand-in's public names that CuPy lacks on purpose: what the tests read or zmpi asks of
# the stand-in alone. Its names that start with "_" (not dunders) are its machinery, private
# by Python's convention (zmpi reads none: test_zmpi_reads_no_private_name_of_cupy).
STANDIN_ONLY = {
    "cupy.STANDIN": "marks the stand-in: tests/conftest.py and the GPU tests skip on it",
    "cupy.SYNCS": "counter of blocking device -> host transfers, read by the tests",
    "cupy.LAUNCHES": "counter of the kernel launches and copies a GPU would run",
    "cupy.CASTS": "counter of the dtype casts among LAUNCHES",
    "cupy.trace_launches": "counts launches (or casts) by call site: where a count comes from",
    "cupy.launch_twin": "runs a fused kernel's NumPy twin; zmpi.kernels takes its presence to "
                        "mean the stand-in",
    "cupy.cuda.PINNED": "counter of pinned host bytes allocated",
    "cupy.cuda.pinned_bytes": "reads PINNED",
    "cupy.cuda.thread_devices": "each host thread's current device, for tests/test_gpu_comm.py",
}

# Private classes of the stand-in whose objects zmpi gets from it, and the CuPy classes they
# stand in for (constructors not compared: zmpi gets these objects, it never builds them).
PRIVATE_CLASSES = {
    "cupy._Pool": "cupy.cuda.MemoryPool",  # get_default_memory_pool()
    "cupy._Memory": "cupy.cuda.MemoryPointer",  # what the allocator (the pool's malloc) returns
    "cupy._DevicePointer": "cupy.cuda.MemoryPointer",  # ndarray.data
    "cupy._Ufunc": "cupy.ufunc",  # cupy.add and the other ufuncs
}

# A class of the stand-in that stands in for a module of CuPy (its static methods: the module's
# functions).
NAMESPACES = {"cupy.cuda.runtime"}

# Dunders that every class has, or that the class's signature covers (__init__).
_PLAIN_DUNDERS = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
                  "__slots__", "__init__", "__annotations__", "__firstlineno__",
                  "__static_attributes__", "__hash__"}
_PLAIN_TYPES = (bool, int, float, str, bytes, type(None))
_POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")


# -- the child processes: each describes one side as JSON ------------------------------------

def _parameters(signature) -> list:
    """[name, kind, has a default, the default as text] of each parameter but a leading self."""
    out = []
    for p in signature.parameters.values():
        if not out and p.name == "self":
            continue
        default = p.default
        text = default.__name__ if isinstance(default, type) else repr(default)
        out.append([p.name, p.kind.name, default is not p.empty, text])
    return out


def _split_top(text: str) -> list[str]:
    """`text` split at its commas outside brackets and quotes."""
    parts, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def _docstring_signature(obj):
    """The signature that Cython's embedsignature writes as a docstring's first line
    (`_ndarray_base.get(self, stream=None, order='C', out=None, blocking=True)`), or the last
    of the signature lines that open the docstring (an author's, more exact than Cython's
    `**kwargs`: RawKernel.__call__); None where there is none."""
    import inspect
    import re

    lines = []
    for line in (getattr(obj, "__doc__", None) or "").splitlines():
        line = line.strip()
        match = re.fullmatch(r"[\w.]+\((.*)\)(\s*->.*)?", line)
        if match:
            lines.append(match.group(1))
        elif line:
            break
    if not lines:
        return None
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = []
    for part in _split_top(lines[-1].replace("\\*", "*")):
        if part == "/":
            parameters = [p.replace(kind=inspect.Parameter.POSITIONAL_ONLY) for p in parameters]
        elif part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
        elif part.startswith("**"):
            parameters.append(inspect.Parameter(part[2:], inspect.Parameter.VAR_KEYWORD))
        elif part.startswith("*"):
            parameters.append(inspect.Parameter(part[1:], inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            name, _, default = (s.strip() for s in part.partition("="))
            name = name.split(":")[0].split()[-1]  # "size_t size", "x: int"
            parameters.append(inspect.Parameter(
                name, kind, default=_Text(default) if default else inspect.Parameter.empty))
    return inspect.Signature(parameters)


class _Text(str):
    """A default as a docstring writes it: its repr is the text."""

    def __repr__(self):
        return str(self)


def _signature(obj):
    """(the parameters, None) of a callable, or (None, why not)."""
    import inspect

    try:
        return _parameters(inspect.signature(obj)), None
    except (TypeError, ValueError) as e:
        found = _docstring_signature(obj)
        if found is None:
            return None, f"{type(e).__name__}: {e}; no signature line in its docstring"
        return _parameters(found), None


def _value_type(value):
    return type(value).__name__ if isinstance(value, _PLAIN_TYPES) else None


def _numpy_name(value):
    """'numpy.float16' for an object of NumPy's (both sides re-export them), else None."""
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if module.split(".")[0] in ("numpy", "ml_dtypes") and name and not isinstance(value, float):
        return f"{module}.{name}"
    return None


def describe_standin() -> list[dict]:
    """The stand-in's public API: an entry for each name, with the CuPy path it must have."""
    import inspect
    import types

    sys.path.insert(0, str(STANDIN_DIR))
    import cupy
    import cupyx

    entries = []
    samples = {cupy.cuda.Stream: cupy.cuda.Stream(), cupy.cuda.Event: cupy.cuda.Event(),
               cupy.cuda.Device: cupy.cuda.Device(), cupy.ndarray: cupy.zeros(1)}
    samples[type(cupy.get_default_memory_pool())] = cupy.get_default_memory_pool()
    samples[type(samples[cupy.ndarray].data)] = samples[cupy.ndarray].data

    def entry(path, real, value, kind=None):
        e = {"path": path, "real": real, "numpy": _numpy_name(value)}
        if kind is None:
            kind = "callable" if callable(value) else "data"
        e["kind"] = kind
        if kind == "callable":
            e["signature"], e["why"] = _signature(value)
        if kind == "data":
            e["type"] = _value_type(value)
        entries.append(e)
        return e

    def walk_class(cls, path, real, constructor=True):
        if constructor:
            entry(path, real, cls, "callable")
        for name, static in vars(cls).items():
            dunder = name.startswith("__") and name.endswith("__")
            if name in _PLAIN_DUNDERS or name.startswith("_") and not dunder:
                continue
            member = f"{path}.{name}"
            if dunder:
                entry(member, f"{real}.{name}", static, "dunder")
            elif isinstance(static, (property, types.MemberDescriptorType)):
                entry(member, f"{real}.{name}", static, "data")["type"] = None
            else:
                entry(member, f"{real}.{name}", getattr(cls, name))
        sample = samples.get(cls)
        for name, value in getattr(sample, "__dict__", {}).items():
            if not name.startswith("_") and name not in vars(cls):
                entry(f"{path}.{name}", f"{real}.{name}", value, "data")

    def walk_module(module, path):
        names = dict(vars(module))
        if path == "cupy":
            names = {k: v for k, v in names.items() if not k.startswith("_")}
            names["__version__"] = module.__version__
        for name, value in names.items():
            if name.startswith("_") and name != "__version__":
                continue
            where = f"{path}.{name}"
            if inspect.ismodule(value):
                if value.__name__ == where:
                    entry(where, where, value, "module")
                    walk_module(value, where)
                elif value.__name__.split(".")[0] in ("cupy", "cupyx"):
                    entry(where, where, value, "module")  # the stand-in's module by another name
                continue  # another library's module, imported
            if where in NAMESPACES:
                entry(where, where, value, "module")
                for fn in (n for n in vars(value) if not n.startswith("_")):
                    entry(f"{where}.{fn}", f"{where}.{fn}", getattr(value, fn))
            elif isinstance(value, type) and not _numpy_name(value):
                walk_class(value, where, where)
            else:
                entry(where, where, value)

    walk_module(cupy, "cupy")
    walk_module(cupyx, "cupyx")
    for path, real in PRIVATE_CLASSES.items():
        walk_class(getattr(cupy, path.split(".")[1]), path, real, constructor=False)
    return entries


def describe_cupy(paths: list[str]) -> dict:
    """CuPy's side of each dotted path: whether it exists, its kind, type and signature."""
    import importlib
    import inspect
    import types

    import cupy

    descriptors = (property, types.GetSetDescriptorType, types.MemberDescriptorType)
    found = {"__version__": cupy.__version__, "__file__": cupy.__file__}
    for path in paths:
        parts = path.split(".")
        value, parent = importlib.import_module(parts[0]), None
        try:
            for part in parts[1:]:
                parent, value = value, getattr(value, part)
        except AttributeError as e:
            found[path] = {"exists": False, "why": str(e)}
            continue
        static = inspect.getattr_static(parent, parts[-1]) if isinstance(parent, type) else value
        e = {"exists": True, "numpy": _numpy_name(value)}
        if inspect.ismodule(value):
            e["kind"] = "module"
        elif isinstance(static, descriptors):
            e["kind"], e["type"] = "data", None
        elif callable(value):
            e["kind"] = "callable"
            e["signature"], e["why"] = _signature(value)
        else:
            e["kind"], e["type"] = "data", _value_type(value)
        found[path] = e
    return found


def describe_direct_calls(cublas_names: list[str]) -> dict:
    """CuPy's side of what zmpi calls directly and the stand-in lacks (test_zmpi_calls_...):
    cupy_backends' cuBLAS (loaded against an empty libcublas: the caller's LD_LIBRARY_PATH,
    and lazy binding, as nothing is called), cupy.cuda.device, RawModule."""
    import importlib

    sys.setdlopenflags(os.RTLD_LAZY)
    import cupy

    cublas = importlib.import_module("cupy_backends.cuda.libs.cublas")
    found = {"cublas": {}, "runtime": sorted(n for n in dir(cupy.cuda.runtime)
                                             if n.startswith("CUDA_R_"))}
    for name in cublas_names:
        value = getattr(cublas, name, None)
        found["cublas"][name] = {"exists": hasattr(cublas, name), "callable": callable(value),
                                 "signature": _signature(value)[0] if callable(value) else None}
    for path in ("cupy.cuda.device.get_cublas_handle", "cupy.RawModule",
                 "cupy.RawModule.get_function", "cupy.RawKernel.__call__"):
        value = cupy
        for part in path.split(".")[1:]:
            value = getattr(value, part)
        found[path] = _signature(value)[0]
    return found


# -- the comparison ---------------------------------------------------------------------------

def _defaults(p, r, problems):
    name, _, has, text = p
    if has and not r[2]:
        problems.append(f"`{name}` is optional in the stand-in, required in CuPy")
    elif has and r[2] and text != r[3]:
        problems.append(f"`{name}` defaults to {text} in the stand-in, {r[3]} in CuPy")


def incompatibilities(stand: list, real: list) -> tuple[list[str], list[str]]:
    """(what the stand-in accepts that CuPy refuses or reads otherwise, notes on what the
    stand-in passes on uncompared) for two parameter lists (`_parameters`)."""
    problems, notes = [], []
    positional = [r for r in real if r[1] in _POSITIONAL]
    keywords = {r[0]: r for r in real if r[1] in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")}
    var_positional = any(r[1] == "VAR_POSITIONAL" for r in real)
    var_keyword = any(r[1] == "VAR_KEYWORD" for r in real)
    covered, index = set(), 0
    for p in stand:
        name, kind = p[0], p[1]
        if name.startswith("_") and p[2]:
            continue  # the stand-in's private keyword, which no caller passes
        if kind in _POSITIONAL:
            r = positional[index] if index < len(positional) else None
            index += 1
            if r is None:
                if not var_positional:
                    problems.append(f"takes `{name}` as positional argument {index}; CuPy takes "
                                    f"{len(positional)}")
                elif kind == "POSITIONAL_OR_KEYWORD" and name not in keywords and not var_keyword:
                    problems.append(f"takes `{name}` by keyword; CuPy only by position (*args)")
                continue
            covered.add(r[0])
            if kind == "POSITIONAL_OR_KEYWORD" and r[0] != name:
                problems.append(f"positional argument {index} is `{name}`, CuPy's is `{r[0]}`")
            elif kind == "POSITIONAL_OR_KEYWORD" and r[1] == "POSITIONAL_ONLY":
                problems.append(f"takes `{name}` by keyword; CuPy only by position")
            else:
                _defaults(p, r, problems)
        elif kind == "KEYWORD_ONLY":
            r = keywords.get(name)
            if r is None:
                if not var_keyword:
                    problems.append(f"takes keyword `{name}`, which CuPy does not")
                continue
            covered.add(name)
            _defaults(p, r, problems)
        elif not name.startswith("_"):
            notes.append(f"{'*' if kind == 'VAR_POSITIONAL' else '**'}{name} passed on")
    passes_on = {p[1] for p in stand} & {"VAR_POSITIONAL", "VAR_KEYWORD"}
    for r in real:
        if r[2] or r[0] in covered or r[1] in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            continue
        if r[1] == "KEYWORD_ONLY" and "VAR_KEYWORD" in passes_on or \
                r[1] in _POSITIONAL and "VAR_POSITIONAL" in passes_on:
            continue
        problems.append(f"CuPy requires `{r[0]}`, which may be left out here")
    return problems, notes


def compare(standin: list[dict], cupy: dict) -> tuple[list[str], list[str], list[str]]:
    """(mismatches, not introspectable in CuPy, notes), one line each."""
    mismatches, opaque, notes = [], [], []
    for e in standin:
        path, real = e["path"], e["real"]
        if path in STANDIN_ONLY or path.rsplit(".", 1)[0] in STANDIN_ONLY:
            continue
        c = cupy[real]
        where = path if path == real else f"{path} (CuPy's {real})"
        if not c["exists"]:
            mismatches.append(f"{where}: not in CuPy {cupy['__version__']} ({c['why']})")
            continue
        if e["kind"] == "dunder":
            continue
        if e["kind"] != c["kind"]:
            mismatches.append(f"{where}: a {e['kind']} in the stand-in, a {c['kind']} in CuPy")
            continue
        if e["kind"] == "data" and e["type"] and c["type"] and e["type"] != c["type"]:
            mismatches.append(f"{where}: a {e['type']} in the stand-in, a {c['type']} in CuPy")
        if e["kind"] != "callable" or e["numpy"] and e["numpy"] == c["numpy"]:
            continue  # a value, or the same object of NumPy's on both sides
        if e["signature"] is None:
            mismatches.append(f"{where}: the stand-in's signature cannot be read ({e['why']})")
        elif c["signature"] is None:
            opaque.append(f"{where}: {c['why']}")
        else:
            problems, passed_on = incompatibilities(e["signature"], c["signature"])
            mismatches += [f"{where}: {p}" for p in problems]
            notes += [f"{where}: {n}" for n in passed_on]
    return mismatches, opaque, notes


# -- the tests --------------------------------------------------------------------------------

def _real_cupy_dir() -> Path:
    """REAL_CUPY, or a skip (a failure on CI) where `make install` could not put CuPy there."""
    if not (REAL_CUPY / "cupy" / "__init__.py").exists():
        why = (f"CuPy {CUPY_VERSION} is not installed in {REAL_CUPY}: `make install` puts it "
               "there (its real-cupy step, which needs PyPI)")
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(why)
        pytest.skip(why)
    return REAL_CUPY


def _child(*args, stdin=None, **env) -> object:
    out = subprocess.run([sys.executable, "-I", __file__, *args], input=stdin, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_standin_is_a_subset_of_cupy():
    real_dir = _real_cupy_dir()
    standin = _child("standin")
    cupy = _child("cupy", str(real_dir), stdin=json.dumps(sorted({e["real"] for e in standin})))
    assert cupy["__version__"] == CUPY_VERSION, (
        f"{real_dir} holds CuPy {cupy['__version__']}, not {CUPY_VERSION}: `make install`")
    assert cupy["__file__"].startswith(str(real_dir)), cupy["__file__"]
    mismatches, opaque, notes = compare(standin, cupy)
    print(f"{len(standin)} names of the stand-in against CuPy {cupy['__version__']}; passed on "
          "uncompared:", *notes, sep="\n  ")
    if opaque:
        warnings.warn(f"{len(opaque)} signatures of CuPy {CUPY_VERSION} cannot be read, not "
                      "compared: " + "; ".join(opaque), stacklevel=1)
    assert not mismatches, (f"the stand-in accepts what CuPy {cupy['__version__']} does not "
                            f"({len(mismatches)}):\n  " + "\n  ".join(mismatches))
    assert not set(STANDIN_ONLY) - {e["path"] for e in standin}, "STANDIN_ONLY is stale"
    stand_in_cupy = [p for p in STANDIN_ONLY if cupy.get(p, {}).get("exists")]
    assert not stand_in_cupy, f"named stand-in-only, but in CuPy: {stand_in_cupy}"


def _zmpi_nodes():
    """(file, node) of every node of zmpi's sources."""
    for source in sorted((REPO_ROOT / "zmpi").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            yield source.relative_to(REPO_ROOT), node


def _calls(attribute: str | None = None, receiver: str | None = None) -> list:
    """(file:line, call) of every call in zmpi of `receiver.attribute(...)` (any attribute or
    receiver where None)."""
    return [(f"{source}:{node.lineno}", node) for source, node in _zmpi_nodes()
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and attribute in (None, node.func.attr) and (receiver is None or isinstance(
                node.func.value, ast.Name) and node.func.value.id == receiver)]


def _launches() -> list:
    """(file:line, call) of zmpi's kernel launches: `_function(name, dtype, acc)(grid, block,
    args)` in zmpi/kernels/__init__.py, `function(grid, block, args, shared_mem=...)` in
    zmpi/kernels/flash_attention.py."""
    return [(f"{source}:{node.lineno}", node) for source, node in _zmpi_nodes()
            if source.parent.name == "kernels" and source.name.endswith(".py")
            and isinstance(node, ast.Call) and (
                isinstance(node.func, ast.Name) and node.func.id == "function"
                or isinstance(node.func, ast.Call) and isinstance(node.func.func, ast.Name)
                and node.func.func.id == "_function")]


def _call_parameters(call: ast.Call) -> list:
    """A call's arguments as `_parameters` writes a signature: its positional arguments by
    position, its keywords by name, so that incompatibilities() says what CuPy refuses."""
    assert not any(isinstance(a, ast.Starred) for a in call.args) and all(
        k.arg for k in call.keywords), ast.unparse(call)
    return [[f"argument {i + 1}", "POSITIONAL_ONLY", False, ""] for i in range(len(call.args))] \
        + [[k.arg, "KEYWORD_ONLY", False, ""] for k in call.keywords]


def test_zmpi_calls_cupy_where_the_standin_does_not_reach():
    """The CuPy that zmpi calls directly and no stand-in runs (the CUDA launchers run on
    tests/cuda_cpu.py, which takes what they pass): every `cublas.X` of zmpi exists in
    cupy_backends.cuda.libs.cublas, and each call of one passes what its signature takes
    (gemmStridedBatchedEx's 23 arguments); cupy.cuda.runtime names each cudaDataType of
    kernels._GEMM_TYPES; cupy.cuda.device.get_cublas_handle takes no argument; and every
    RawModule(...), .get_function(...) and kernel launch `f(grid, block, args, shared_mem=)`
    passes what CuPy's take. cuBLAS loads against an empty libcublas built here (a C compiler:
    skipped without one), as no function of it runs."""
    import shutil

    from zmpi import kernels

    real_dir = _real_cupy_dir()
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        pytest.skip("no C compiler for the empty libcublas that cupy_backends' cublas loads")
    names = sorted({node.attr for _, node in _zmpi_nodes() if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name) and node.value.id == "cublas"})
    assert "gemmStridedBatchedEx" in names, "zmpi no longer calls cuBLAS: update this test"
    stubs = Path(tempfile.mkdtemp(prefix="zmpi-libcublas-"))
    try:
        (stubs / "empty.c").write_text("")
        for version in (12, 13):  # cupy-cuda12x's and cupy-cuda13x's
            name = f"libcublas.so.{version}"
            subprocess.run([compiler, "-shared", "-fPIC", "-o", str(stubs / name),
                            f"-Wl,-soname,{name}", str(stubs / "empty.c")], check=True)
        cupy = _child("calls", str(real_dir), stdin=json.dumps(names),
                      LD_LIBRARY_PATH=str(stubs))
    finally:
        shutil.rmtree(stubs)
    problems = [f"cublas.{n}: not in cupy_backends.cuda.libs.cublas" for n in names
                if not cupy["cublas"][n]["exists"]]
    calls = [(where, call, cupy["cublas"][call.func.attr]["signature"])
             for where, call in _calls(receiver="cublas")]
    calls += [(where, call, cupy["cupy.RawModule"]) for where, call in _calls("RawModule")]
    calls += [(where, call, cupy["cupy.RawModule.get_function"])
              for where, call in _calls("get_function")]
    launches = _launches()
    assert len(launches) >= 2, launches  # kernels._launch's and flash_attention._launch's
    calls += [(where, call, cupy["cupy.RawKernel.__call__"]) for where, call in launches]
    for where, call, signature in calls:
        if signature is None:
            problems.append(f"{where}: CuPy's signature of {ast.unparse(call.func)} unread")
            continue
        problems += [f"{where}: {ast.unparse(call.func)}(...): {p}" for p in
                     incompatibilities(_call_parameters(call), signature)[0]]
    problems += [f"kernels._GEMM_TYPES: cupy.cuda.runtime has no {t}"
                 for t in kernels._GEMM_TYPES.values() if t not in cupy["runtime"]]
    if cupy["cupy.cuda.device.get_cublas_handle"] != []:
        problems.append(f"get_cublas_handle takes {cupy['cupy.cuda.device.get_cublas_handle']}")
    print(f"{len(calls)} calls checked:", *(f"{w}: {ast.unparse(c.func)}" for w, c, _ in calls),
          sep="\n  ")
    assert not problems, "\n".join(problems)


def test_zmpi_reads_no_private_name_of_cupy():
    """What the comparison leaves out of the stand-in (its names starting with "_") is not
    what zmpi reads: no `xp._x`, `cupy._x` or `cupyx._x` in zmpi."""
    found = []
    for source in sorted((REPO_ROOT / "zmpi").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in ("xp", "cupy", "cupyx")):
                found.append(f"{source.relative_to(REPO_ROOT)}:{node.lineno}: "
                             f"{node.value.id}.{node.attr}")
    assert not found, found


def test_the_comparison_finds_what_cupy_refuses():
    """incompatibilities() on made-up signatures: each rule once."""
    def params(*specs):
        return [[n, k, d is not None, d or ""] for n, k, d in specs]

    PK, KO, PO = "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY", "POSITIONAL_ONLY"
    real = params(("a", PK, None), ("stream", PK, "None"), ("order", PK, "'C'"),
                  ("out", PK, "None"), ("blocking", KO, "True"))
    assert incompatibilities(params(("a", PK, None), ("stream", PK, "None"),
                                    ("order", PK, "'C'")), real) == ([], [])
    assert incompatibilities(params(("a", PK, None), ("stream", PK, "None"),
                                    ("out", PK, "None")), real)[0] == [
        "positional argument 3 is `out`, CuPy's is `order`"]
    assert incompatibilities(params(("a", PK, None), ("blocking", KO, "False")), real)[0] == [
        "`blocking` defaults to False in the stand-in, True in CuPy"]
    assert incompatibilities(params(("a", PK, "None")), real)[0] == [
        "`a` is optional in the stand-in, required in CuPy"]
    assert incompatibilities(params(("a", PK, None), ("copy", KO, "True")), real)[0] == [
        "takes keyword `copy`, which CuPy does not"]
    assert incompatibilities(params(("x", PK, None)), params(("x", PO, None)))[0] == [
        "takes `x` by keyword; CuPy only by position"]
    assert incompatibilities(params(("x", PO, None), ("y", PO, None)),
                             params(("x", PO, None)))[0] == [
        "takes `y` as positional argument 2; CuPy takes 1"]
    assert incompatibilities(params(("x", PO, None)), params(("x", PO, None), ("k", KO, None)))[
        0] == ["CuPy requires `k`, which may be left out here"]
    variadic = [["args", "VAR_POSITIONAL", False, ""], ["kwargs", "VAR_KEYWORD", False, ""]]
    assert incompatibilities(variadic, real) == ([], ["*args passed on", "**kwargs passed on"])


def test_docstring_signatures_read_as_cython_writes_them():
    def fn():
        """_ndarray_base.get(self, stream=None, order='C', out=None, blocking=True) -> x

        RawModule(str code=None, *, tuple options=(), name_expressions=None)

        Words."""

    assert _parameters(_docstring_signature(fn)) == [
        ["code", "POSITIONAL_OR_KEYWORD", True, "None"],
        ["options", "KEYWORD_ONLY", True, "()"],
        ["name_expressions", "KEYWORD_ONLY", True, "None"]]
    fn.__doc__ = "add(x1, x2, /, out=None, \\*, casting='same_kind', dtype=None)\n\nAdds."
    assert [p[:2] for p in _parameters(_docstring_signature(fn))] == [
        ["x1", "POSITIONAL_ONLY"], ["x2", "POSITIONAL_ONLY"], ["out", "POSITIONAL_OR_KEYWORD"],
        ["casting", "KEYWORD_ONLY"], ["dtype", "KEYWORD_ONLY"]]


if __name__ == "__main__":  # a child of the tests: python -I tests/test_standin_api.py ...
    if sys.argv[1] == "standin":
        print(json.dumps(describe_standin()))
    else:
        sys.path.insert(0, sys.argv[2])
        describe = describe_cupy if sys.argv[1] == "cupy" else describe_direct_calls
        print(json.dumps(describe(json.loads(sys.stdin.read()))))

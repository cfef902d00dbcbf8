"""A strict stand-in for CuPy, for running zmpi's GPU path on a machine without a GPU.

Put `tests/standin` on PYTHONPATH and set ZMPI_BACKEND=cupy: `import cupy` then finds this
package. It is a test double for hardware this machine lacks, not a GPU: arithmetic runs in
NumPy on the host. What it enforces is CuPy's discipline where zmpi could get it wrong:

- `ndarray` is its own type, not a NumPy array: NumPy functions and ufuncs refuse it
  (`np.asarray(d)` raises TypeError, as CuPy does), and its operations refuse NumPy arrays
  (scalars are fine), including `out=` arguments and assignment `d[...] = host_array`;
- host <-> device copies are explicit: `cupy.asarray(host)`, `d.get()`, `d.set(host)`;
- streams and events exist (`cuda.Stream`, `record`, `wait_event`, `Event.done`) and pinned
  host memory (`cuda.alloc_pinned_memory`, `cupyx.empty_pinned`) is counted;
- every array that owns device memory takes it from the current allocator
  (`cuda.get_allocator()`, `cuda.set_allocator(f)`; the default is the pool's `malloc`), and the
  default memory pool counts the bytes of live ones (`get_default_memory_pool().used_bytes()`,
  `total_bytes()`). Like CuPy's, the pool keeps no peak: wrap the allocator to watch one.

It also counts what a GPU would pay for (stand-in only): `LAUNCHES[0]`, the device operations
a GPU runs as one kernel launch or copy each (a ufunc, a reduction, an operator, a copy that
astype / reshape / ravel / fancy indexing / assignment makes, a matmul plus the operand copies
CuPy makes for it, a host <-> device transfer, a fused kernel run through `launch_twin`;
views, `empty` and scalar attributes are free); `CASTS[0]`, those of them that are dtype
casts, kernels CuPy names `cupy_copy__float16_float32` and the like (also in LAUNCHES); and
`SYNCS[0]`, the blocking device -> host value transfers. `trace_launches()` records where each
launch came from (file:line of the caller), `trace_launches(casts=True)` where each cast did
(not `trace`: that is CuPy's, the sum of a diagonal).

Casts as CuPy 14.2 launches them (cupy/_core): an astype, a copy, an assignment
(`a[...] = b`), copyto or ascontiguousarray(dtype=) that changes the dtype is one
`cupy_copy` kernel between the two dtypes. A ufunc with inputs of mixed dtypes, or an `out=`
of another dtype, converts inside its own kernel (`cupy_add__float16_float32_float32`): no
cast. A reduction with `dtype=` likewise. A matmul of more than two dimensions
(`_routines_linalg.matmul`) computes float16 in float32: it casts each float16 operand to
float32 (one kernel each, which also makes it contiguous), runs an fp32 GEMM and casts the
float32 product into the float16 result; a 2-D one (`dot`) runs float16 on tensor cores and
casts only operands of mixed dtypes.

bfloat16 (`ml_dtypes.bfloat16`, as CuPy 14): arrays, ufuncs and reductions as NumPy with
ml_dtypes computes them; a 2-D matmul is cuBLAS's (float32 accumulation, rounded once to
bfloat16, no cast); a batched one raises TypeError, as CuPy 14.2's does (its batched matmul
sends bfloat16 to its integer kernels, which have none: cupy/cupy#10317), so zmpi must run
those through zmpi.kernels.matmul.
"""
import inspect as _inspect
import weakref

import ml_dtypes as _ml_dtypes
import numpy as _np

from . import cuda  # noqa: F401  (cupy.cuda)

__version__ = "14.2.0-standin"
STANDIN = True
SYNCS = [0]  # stand-in only: device -> host value transfers so far (float(), int(), .get())
LAUNCHES = [0]  # stand-in only: kernel launches and copies a GPU would run so far
CASTS = [0]  # stand-in only: of those, the dtype casts (cupy_copy between two dtypes)
_TRACE = [None, False]  # a Counter of launch (or cast) sites while tracing; casts only?
_BFLOAT16 = _np.dtype(_ml_dtypes.bfloat16)


def _launch(n=1, casts=0):
    """Count n launches, `casts` of them dtype casts (and their call site while tracing)."""
    LAUNCHES[0] += n
    CASTS[0] += casts
    counted = casts if _TRACE[1] else n
    if _TRACE[0] is not None and counted:
        import sys

        frame = sys._getframe(1)
        while frame.f_globals.get("__name__", "").startswith(("cupy", "cupyx")):
            frame = frame.f_back
        site = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        _TRACE[0][site] += counted


def _cast(src_dtype, dtype):
    """One copy kernel from src_dtype to dtype: a launch, and a cast if the dtypes differ."""
    _launch(1, int(_np.dtype(src_dtype) != _np.dtype(dtype)))


class trace_launches:  # noqa: N801 (used as a function)
    """`with cupy.trace_launches() as sites:` counts launches by call site (a
    collections.Counter); `trace_launches(casts=True)` counts only the casts."""

    def __init__(self, casts=False):
        self.casts = casts

    def __enter__(self):
        import collections

        _TRACE[:] = collections.Counter(), self.casts
        return _TRACE[0]

    def __exit__(self, *exc):
        _TRACE[:] = None, False


def _signature(params):
    """The inspect.Signature of a parameter list written as in Python ("a, axis=None")."""
    namespace = {}
    exec(f"def f({params}): pass", namespace)
    return _inspect.signature(namespace["f"])


def _copied(src, result):
    """1 when `result` is a new buffer rather than a view of `src` (a copy kernel ran)."""
    return 0 if _np.may_share_memory(src, result) else 1


class _Memory:
    """A block of device memory (CuPy's MemoryPointer, reduced to its size); the pool counts
    it until it is collected."""

    __slots__ = ("_size", "__weakref__")

    def __init__(self, size):
        self._size = size


class _Pool:
    def __init__(self):
        self._used = 0

    def _add(self, n):
        self._used += n

    def malloc(self, size):
        mem = _Memory(size)
        self._add(size)
        weakref.finalize(mem, self._add, -size)
        return mem

    def used_bytes(self):
        return self._used

    def total_bytes(self):
        return self._used

    def free_all_blocks(self, stream=None):
        pass


_POOL = _Pool()


def get_default_memory_pool():
    return _POOL


def _floating(dtype):
    return dtype.kind == "f" or dtype == _BFLOAT16


def _poison(a):
    """Fill `a` with values no computation expects (NaN, or all bits set): the state of a
    buffer a copy has not reached yet."""
    if _floating(a.dtype):
        a.fill(_np.nan)
    else:
        a.view(_np.uint8).fill(0xFF)


def _refuse(x):
    raise TypeError(f"Unsupported type {type(x)}: the cupy stand-in refuses host NumPy arrays "
                    "here; copy explicitly with cupy.asarray(...) or .get()")


def _unwrap(x):
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, _np.ndarray):
        _refuse(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _wrap(a):
    if isinstance(a, _np.ndarray):
        return ndarray(a)
    if isinstance(a, _np.generic):  # CuPy returns 0-d arrays, not scalars
        return ndarray(_np.asarray(a))
    return a


class ndarray:  # noqa: N801 (CuPy's name)
    """A device array: a NumPy array behind a wall."""

    __array_ufunc__ = None  # NumPy ufuncs refuse it
    __slots__ = ("_a", "_mem", "__weakref__")

    def __init__(self, a):
        self._a = a
        # owns its memory: take it from the allocator (the pool counts it while it lives)
        self._mem = cuda.get_allocator()(a.nbytes) if a.base is None else None

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __array_function__(self, func, types, args, kwargs):
        return NotImplemented  # NumPy functions refuse it

    # -- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    flags = property(lambda self: self._a.flags)
    strides = property(lambda self: self._a.strides)
    T = property(lambda self: ndarray(self._a.T))

    @property
    def data(self):
        return _DevicePointer(self._a)

    @property
    def __cuda_array_interface__(self):
        """What a CUDA-aware MPI reads through mpi4py: the address of the memory (host memory
        here, so a host MPI can serve the stand-in's "CUDA-aware" mode)."""
        if not self._a.flags.c_contiguous:
            raise BufferError("not contiguous")
        return {"shape": self._a.shape, "typestr": self._a.dtype.str,
                "data": (self._a.ctypes.data, False), "version": 3, "strides": None}

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"cupy-standin.{self._a!r}"

    # -- explicit copies
    def get(self, stream=None, order="C", out=None, blocking=True):
        """As CuPy 14.2's (cupy/_core/core.pyx): a copy kernel first where the array's layout
        is not the host array's (out's, or `order`: C, F, or A for F where the array is
        F-contiguous), then the transfer, a sync unless blocking=False; nothing for an empty
        array without `out`."""
        src = self._a
        if out is None:
            if src.size == 0:
                return _np.empty(src.shape, src.dtype)
            order = order.upper()
            if order == "A":
                order = "F" if src.flags.f_contiguous else "C"
            if order not in ("C", "F"):
                raise ValueError(f"unsupported order: {order}")
            out = _np.empty(src.shape, src.dtype, order=order)
        if isinstance(out, ndarray):
            raise TypeError("out must be a NumPy array")
        if out.shape != src.shape:
            raise ValueError(f"get(): out shape {out.shape} != {src.shape}")
        if out.dtype != src.dtype:
            raise TypeError(f"get(): out dtype {out.dtype} != {src.dtype}")
        if not (out.flags.c_contiguous and src.flags.c_contiguous
                or out.flags.f_contiguous and src.flags.f_contiguous):
            if not (out.flags.c_contiguous or out.flags.f_contiguous):
                raise RuntimeError("`out` cannot be specified when copying to non-contiguous "
                                   "ndarray")
            _launch()  # the array copied into out's layout on the device first
        _launch()
        if blocking:
            SYNCS[0] += 1
        if stream is not None and not blocking and not stream._null:
            _poison(out)  # the copy lands when its stream's event is waited for
            stream._queue(lambda: _np.copyto(out, src))
        else:
            _np.copyto(out, src)
        return out

    def set(self, arr, stream=None):
        if not isinstance(arr, _np.ndarray):
            raise TypeError(f"set() takes a NumPy array, got {type(arr)}")
        if arr.dtype != self._a.dtype:
            raise TypeError(f"set(): dtype {arr.dtype} != {self._a.dtype}")
        if arr.shape != self._a.shape:
            raise ValueError(f"set(): shape {arr.shape} != {self._a.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):  # as CuPy 14.2's
            raise RuntimeError("Cannot set to non-contiguous array")
        dst = self._a
        _launch()
        if stream is not None and not stream._null:
            _poison(dst)
            stream._queue(lambda: dst.__setitem__(Ellipsis, arr))
        else:
            dst[...] = arr

    # -- conversion to host values (each a device -> host transfer and a sync on a GPU,
    # counted in SYNCS)
    def __float__(self):
        SYNCS[0] += 1
        return float(self._a)

    def __int__(self):
        SYNCS[0] += 1
        return int(self._a)

    def __bool__(self):
        SYNCS[0] += 1
        return bool(self._a)

    def tolist(self):
        SYNCS[0] += 1
        return self._a.tolist()

    def item(self):
        SYNCS[0] += 1
        return self._a.item()

    # -- indexing
    def __getitem__(self, key):
        result = self._a[_unwrap(key)]
        if isinstance(result, _np.ndarray):
            _launch(_copied(self._a, result))  # fancy indexing gathers; slicing is a view
        return _wrap(result)

    def __setitem__(self, key, value):
        _cast(value.dtype if isinstance(value, ndarray) else self.dtype, self.dtype)
        self._a[_unwrap(key)] = _unwrap(value)

    # -- methods
    def reshape(self, *shape, order="C"):
        result = self._a.reshape(*shape, order=order)
        _launch(_copied(self._a, result))
        return ndarray(result)

    def view(self, dtype=None):
        return ndarray(self._a.view(dtype))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        out = self._a.astype(dtype, order=order, casting=casting or "unsafe", copy=copy)
        if out is self._a:
            return self
        _cast(self.dtype, out.dtype)
        return ndarray(out)

    def copy(self):
        _launch()
        return ndarray(self._a.copy())

    def fill(self, value):
        _launch()
        self._a.fill(value)

    def ravel(self):
        result = self._a.ravel()
        _launch(_copied(self._a, result))
        return _wrap(result)

    def transpose(self, *axes):
        return ndarray(self._a.transpose(*axes))

    def swapaxes(self, axis1, axis2):
        return ndarray(self._a.swapaxes(axis1, axis2))


_KEEP = "out=None, keepdims=False"
for _name, _params in {  # CuPy 14.2's parameters (a call CuPy refuses raises TypeError here)
        "sum": f"axis=None, dtype=None, {_KEEP}", "max": f"axis=None, {_KEEP}",
        "min": f"axis=None, {_KEEP}", "mean": f"axis=None, dtype=None, {_KEEP}",
        "all": f"axis=None, {_KEEP}", "any": f"axis=None, {_KEEP}",
        "argmax": "axis=None, out=None, dtype=None, keepdims=False",
        "var": "axis=None, dtype=None, out=None, ddof=0, keepdims=False",
        "std": "axis=None, dtype=None, out=None, ddof=0, keepdims=False",
        "prod": "axis=None, dtype=None, out=None, keepdims=None"}.items():
    _accepted = _signature(f"self, {_params}")

    def _reduction(self, *args, _name=_name, _accepts=_accepted, **kwargs):
        _accepts.bind(self, *args, **kwargs)
        out = kwargs.pop("out", None)
        _launch()
        if out is not None:  # CuPy returns `out` itself
            getattr(self._a, _name)(*_unwrap(args), out=_unwrap(out), **_unwrap(kwargs))
            return out
        return _wrap(getattr(self._a, _name)(*_unwrap(args), **_unwrap(kwargs)))
    _reduction.__signature__ = _accepted
    setattr(ndarray, _name, _reduction)

for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
            "xor", "lt", "le", "gt", "ge", "eq", "ne"):
    for _fmt in ("__{}__", "__r{}__", "__i{}__"):
        _dunder = _fmt.format(_op)
        if not hasattr(_np.ndarray, _dunder) or _dunder == "__imatmul__":  # CuPy has none:
            continue  # `a @= b` binds a new array to a

        def _binary(self, other, _dunder=_dunder):
            result = getattr(self._a, _dunder)(_unwrap(other))
            if result is NotImplemented:
                return result
            _launch()
            return self if _dunder.startswith("__i") else _wrap(result)
        setattr(ndarray, _dunder, _binary)

for _dunder in ("__neg__", "__pos__", "__abs__", "__invert__"):
    def _unary(self, _d=_dunder):
        _launch()
        return _wrap(getattr(self._a, _d)())
    setattr(ndarray, _dunder, _unary)


class _DevicePointer:
    """`a.data.ptr`: an address, as MPI's CUDA-aware path would read it."""

    def __init__(self, a):
        self.ptr = a.ctypes.data


# -- the module's functions: NumPy's, behind the same wall
_VIEWS = {"empty_like", "broadcast_to", "expand_dims"}  # no device work


def _function(np_fn, params):
    """np_fn behind the wall, taking the calls that CuPy's function of that name takes: its
    parameter list `params` (a call CuPy refuses raises TypeError, NumPy's extras included),
    passed on to NumPy as given."""
    launches = 0 if np_fn.__name__ in _VIEWS else 1
    signature = _signature(params)

    def fn(*args, **kwargs):
        signature.bind(*args, **kwargs)
        out = kwargs.pop("out", None)
        _launch(launches)
        if out is not None:
            if not isinstance(out, ndarray):
                raise TypeError(f"out must be a cupy ndarray, got {type(out)}")
            kwargs["out"] = out._a
        result = np_fn(*_unwrap(args), **_unwrap(kwargs))
        return out if out is not None else _wrap(result)
    fn.__name__ = getattr(np_fn, "__name__", "fn")
    fn.__signature__ = signature
    return fn


class _Ufunc:
    def __init__(self, np_ufunc):
        self._u = np_ufunc
        operands = "x" if np_ufunc.nin == 1 else ", ".join(
            f"x{i + 1}" for i in range(np_ufunc.nin))
        self.__signature__ = _signature(
            f"{operands}, /, out=None, *, casting='same_kind', dtype=None")  # CuPy's ufuncs'
        self._call = _function(np_ufunc, str(self.__signature__)[1:-1])

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def at(self, a, indices, b):
        if not isinstance(a, ndarray):
            raise TypeError("at() needs a cupy ndarray")
        _launch()
        self._u.at(a._a, _unwrap(indices), _unwrap(b))


for _name in ("add", "subtract", "multiply", "divide", "true_divide", "exp", "log", "sqrt",
              "tanh", "maximum", "minimum", "isfinite", "isnan", "power", "negative", "abs",
              "rint",
              "square", "sign", "floor", "equal", "not_equal", "less", "greater", "logical_and",
              "logical_or", "cos", "sin", "erf" if hasattr(_np, "erf") else "exp"):
    globals()[_name] = _Ufunc(getattr(_np, _name))

_LIKE = "dtype=None, order='K', subok=None, shape=None"
_SIGNATURES = {  # CuPy 14.2's (tests/test_standin_api.py compares them with CuPy's own)
    "where": "condition, x=None, y=None",
    "triu": "m, k=0",
    "tril": "m, k=0",
    "stack": "tup, axis=0, out=None, *, dtype=None, casting='same_kind'",
    "concatenate": "tup, axis=0, out=None, *, dtype=None, casting='same_kind'",
    "einsum": "*operands, dtype=None, optimize=False",  # CuPy reads only these two keywords
    "sum": "a, axis=None, dtype=None, out=None, keepdims=False",
    "zeros_like": f"a, {_LIKE}",
    "empty_like": f"prototype, {_LIKE}",
    "ones_like": f"a, {_LIKE}",
    "full_like": f"a, fill_value, {_LIKE}",
    "take_along_axis": "a, indices, axis",
    "argmax": "a, axis=None, dtype=None, out=None, keepdims=False",
    "broadcast_to": "array, shape",
    "expand_dims": "a, axis",
    "clip": "a, a_min, a_max, out=None",
    "cumsum": "a, axis=None, dtype=None, out=None",
    "arange": "start, stop=None, step=1, dtype=None",
    "linspace": "start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0",
    "full": "shape, fill_value, dtype=None, order='C'",
    "packbits": "a, axis=None, bitorder='big'",
    "unpackbits": "a, axis=None, bitorder='big'",
}
for _name, _params in _SIGNATURES.items():
    globals()[_name] = _function(getattr(_np, _name), _params)


def copyto(dst, src, casting="same_kind", where=None):
    """One copy kernel (a cast when the dtypes differ)."""
    if not isinstance(dst, ndarray):
        raise TypeError(f"copyto needs a cupy ndarray, got {type(dst)}")
    _cast(getattr(src, "dtype", dst.dtype), dst.dtype)
    _np.copyto(dst._a, _unwrap(src), casting=casting, where=True if where is None else
               _unwrap(where))

for _name in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint16",
              "bool_", "integer", "floating", "inf", "nan", "pi", "newaxis", "dtype",
              "promote_types", "issubdtype", "result_type", "iinfo", "finfo"):
    globals()[_name] = getattr(_np, _name)


def _matmul_copies(a, b, out):
    """(launches, casts) of the copies CuPy 14.2's matmul makes around its one cuBLAS call
    (cupy/_core/_routines_linalg.pyx). A batched product (ndim > 2) runs in the result dtype,
    float32 for float16: each operand of another dtype is cast (one kernel, contiguous), one of
    that dtype copied unless C-contiguous, and a product of another dtype than the result's,
    or an `out` that is not C-contiguous, is copied (cast) into it. A 2-D one (`dot`, float16
    on tensor cores) casts operands of mixed dtypes to the result dtype, takes any matrix with
    a unit stride along one axis, and copies (casts) into an `out` that is not C-contiguous of
    the result dtype."""
    ret, batched = _np.promote_types(a.dtype, b.dtype), max(a.ndim, b.ndim) > 2
    dtype = _np.dtype(_np.float32) if batched and ret == _np.float16 else ret
    launches = casts = 0
    for x in (a, b):
        cast = x.dtype != dtype
        casts += cast
        launches += cast or (not x.flags.c_contiguous if batched
                             else x.ndim == 2 and x.itemsize not in x.strides)
    result = ret if out is None else out.dtype
    if dtype != result or out is not None and not out.flags.c_contiguous:
        launches += 1
        casts += dtype != result
    return int(launches), int(casts)


def matmul(a, b, /, *, out=None):
    """One cuBLAS call, plus the copies CuPy makes for it (`_matmul_copies`). bfloat16: 2-D
    only (float32 accumulation, rounded once); batched, TypeError as CuPy 14.2's."""
    a_, b_ = _unwrap(a), _unwrap(b)
    bfloat16 = _np.promote_types(a_.dtype, b_.dtype) == _BFLOAT16
    if bfloat16 and max(a_.ndim, b_.ndim) > 2:
        raise TypeError("CuPy 14.2 has no batched bfloat16 matmul (cupy/cupy#10317); use "
                        "zmpi.kernels.matmul")
    _launch(*_matmul_copies(a_, b_, None if out is None else _unwrap(out)))
    if not bfloat16:
        return _matmul_function(a, b, out=out)
    _launch()  # the GEMM
    product = _np.matmul(a_, b_, dtype=_np.float32)
    if out is None:
        return ndarray(product.astype(_BFLOAT16))
    _unwrap(out)[...] = product
    return out


_matmul_function = _function(_np.matmul, "x1, x2, /, out=None")


def dot(a, b, out=None):
    """matmul (zmpi's dot products are of vectors and matrices, where the two agree)."""
    return matmul(a, b, out=out)


ndarray.__matmul__ = lambda self, other: matmul(self, other)
ndarray.__rmatmul__ = lambda self, other: matmul(other, self)


def launch_twin(twin, *args, launches=1):
    """Stand-in only: run a fused op as its NumPy twin, counted as the `launches` GPU
    operations its CUDA launcher runs (none of them a cast). The twin gets the arguments with
    device arrays unwrapped (scalars as they are), may write into them, and its array results
    come back as device arrays. A GPU runs the kernel's CUDA source instead (zmpi.kernels);
    this is how the stand-in runs the same program."""
    _launch(launches)
    given = {}  # id of an unwrapped argument -> its device array

    def unwrap(a):  # arrays, also inside tuples (a cache)
        if isinstance(a, ndarray):
            given[id(a._a)] = a
            return a._a
        return type(a)(unwrap(x) for x in a) if isinstance(a, (tuple, list)) else a

    def rewrap(r):  # an argument handed back is that same device array
        if isinstance(r, (tuple, list)):
            return type(r)(rewrap(x) for x in r)
        return given[id(r)] if id(r) in given else _wrap(r)

    return rewrap(twin(*(unwrap(a) for a in args)))


def zeros(shape, dtype=float, order="C"):
    _launch()
    return ndarray(_np.zeros(shape, dtype))


def empty(shape, dtype=float, order="C"):
    a = _np.empty(shape, dtype)
    a.fill(_np.nan if _floating(a.dtype) else 0)  # garbage, visibly
    return ndarray(a)


def ones(shape, dtype=float):
    _launch()
    return ndarray(_np.ones(shape, dtype))


def asarray(a, dtype=None, order=None):
    """Host -> device (an explicit copy), or a device array as is."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    _launch()  # a host -> device copy (NumPy casts on the host first)
    return ndarray(_np.array(a, dtype=dtype, copy=True))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    """Host -> device, or a copy of a device array (itself only where copy=False)."""
    if isinstance(obj, ndarray) and copy:
        return obj.astype(obj.dtype if dtype is None else dtype)
    return asarray(obj, dtype)


def ascontiguousarray(a, dtype=None):
    """`a` itself when it is C-contiguous of `dtype` (as CuPy: an op that writes into the
    result writes into `a`), else a copy."""
    if not isinstance(a, ndarray):
        _refuse(a)
    if a.flags.c_contiguous and a.ndim and (dtype is None or _np.dtype(dtype) == a.dtype):
        return a
    result = _np.ascontiguousarray(a._a, dtype=dtype)
    _launch(_copied(a._a, result), int(result.dtype != a.dtype))
    return ndarray(result)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return _np.asarray(a)


def get_array_module(*arrays):
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in arrays) else _np

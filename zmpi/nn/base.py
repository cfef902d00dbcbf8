"""Module, the base of every layer and loss, and the accounting of what layers keep for
backward.

Module finds Parameters by walking its attributes (Parameters, Modules, lists/tuples of
Modules) in definition order, so names look like `units.1.attn.qkv.weight`. A module may also
*read* Parameters it does not own (tied weights, e.g. GPT-2's LM head reading the token
embedding); those owners are listed in `shared_units` and are never walked.

This module imports no other part of zmpi.nn but parameter.py: layers.py, losses.py and
module.py (UnitModel) build on it.
"""

from contextlib import contextmanager

from zmpi import backend
from zmpi.nn.parameter import Parameter


class _ActivationAccount:
    """Counts the arrays layers keep for backward in a MemoryLedger, while `counted_in(ledger)`
    is active: as "layer_cache", or as "recompute" while `recomputing()` (a unit's forward run
    again in backward); a checkpointed unit's kept input is held as "saved_input". An array is
    counted by the buffer that owns its memory, once however many caches hold views of it;
    buffers the ledger already holds (parameters, gradients, a preallocated input buffer) are
    not counted again."""

    def __init__(self):
        self.ledger = None
        self.category = "layer_cache"
        self.refs = {}  # id(owner) -> [owner, number of caches holding it]

    def _owners(self, cache):
        for item in cache if isinstance(cache, tuple) else (cache,):
            if isinstance(item, tuple):
                yield from self._owners(item)
            elif hasattr(item, "nbytes") and hasattr(item, "shape") and item.nbytes:
                while getattr(item, "base", None) is not None and hasattr(item.base, "nbytes"):
                    item = item.base
                yield item

    def hold(self, cache, category=None, device=None):
        """Count the arrays in `cache` (nested tuples) under `category` (default: the current
        one) on `device` (default: where each array lives; "device" under NumPy)."""
        if self.ledger is None:
            return
        for owner in self._owners(cache):
            ref = self.refs.get(id(owner))
            if ref is not None:
                ref[1] += 1
            elif not self.ledger.holds(owner):
                on_device = backend.is_device_array(owner) or not backend.is_gpu
                self.ledger.register(owner, category or self.category,  # may raise: budget
                                     device or ("device" if on_device else "host"),
                                     category or self.category)
                self.refs[id(owner)] = [owner, 1]

    def drop(self, cache):
        if self.ledger is None:
            return
        for owner in self._owners(cache):
            ref = self.refs.get(id(owner))
            if ref is not None:
                ref[1] -= 1
                if ref[1] == 0:
                    del self.refs[id(owner)]
                    self.ledger.release(owner)

    @contextmanager
    def recomputing(self):
        """Within this block, what layers save is counted as "recompute"."""
        previous, self.category = self.category, "recompute"
        try:
            yield
        finally:
            self.category = previous


ACTIVATIONS = _ActivationAccount()


@contextmanager
def activations_counted_in(ledger):
    """Within this block, layers' saved activations are registered with `ledger`."""
    previous, ACTIVATIONS.ledger = ACTIVATIONS.ledger, ledger
    try:
        yield
    finally:
        ACTIVATIONS.ledger = previous


class Module:
    """Base class: parameter discovery and the forward/backward cache discipline.

    Subclasses implement `forward(x)`, which stores what backward needs with `_save(...)`, and
    `backward(dy)`, which takes it back with `_pop()` (a RuntimeError without a preceding
    forward, or on a second backward), returns dx and accumulates into each `p.grad`.
    """

    shared_units: tuple = ()  # Modules whose Parameters this one reads but does not own
    _cache = None

    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def __call__(self, x):
        return self.forward(x)

    # -- cache discipline ---------------------------------------------------------------------
    def _save(self, *cache):
        if self._cache is not None:
            ACTIVATIONS.drop(self._cache)  # a second forward replaces the first one's cache
        self._cache = cache
        ACTIVATIONS.hold(cache)

    def _pop(self, stay_counted=False):
        """What `_save` kept (one item: itself; several: a tuple), uncounted in the ledger
        unless `stay_counted` (the caller then drops each part as it lets it go)."""
        cache = self._cache
        if cache is None:
            raise RuntimeError(
                f"{type(self).__name__}.backward called without a preceding forward "
                "(or twice after one forward: the cache is consumed)"
            )
        self._cache = None
        if not stay_counted:
            ACTIVATIONS.drop(cache)
        return cache if len(cache) != 1 else cache[0]

    def take_caches(self) -> list:
        """Detach what this module and its children saved for backward, and return it for
        `restore_caches`: a pipeline stage runs several micro-batches' forwards before their
        backwards. The arrays stay counted as activations until their backward pops them."""
        taken = [(m, m._cache) for m in self.modules() if m._cache is not None]
        for m, _ in taken:
            m._cache = None
        return taken

    @staticmethod
    def restore_caches(taken: list) -> None:
        """Put back what `take_caches` detached, so the next backward uses it."""
        for m, cache in taken:
            if m._cache is not None:
                raise RuntimeError(f"{type(m).__name__} already holds another micro-batch's "
                                   "cache: run its backward first")
            m._cache = cache

    def clear_cache(self):
        """Drop every saved activation in this module and its children (e.g. after inference)."""
        for m in self.modules():
            if m._cache is not None:
                ACTIVATIONS.drop(m._cache)
            m._cache = None

    # -- parameter discovery ------------------------------------------------------------------
    def _children(self):
        """(name, Parameter | Module) pairs owned by this module, in attribute order.

        Skipped: `shared_units` and anything in it, and private attributes (leading `_`).
        """
        shared = {id(m) for m in self.shared_units}
        for name, value in vars(self).items():
            if name == "shared_units" or name.startswith("_") or id(value) in shared:
                continue
            if isinstance(value, (Parameter, Module)):
                yield name, value
            elif isinstance(value, (list, tuple)) and value and all(
                isinstance(v, Module) for v in value
            ):
                for i, v in enumerate(value):
                    if id(v) not in shared:
                        yield f"{name}.{i}", v

    def modules(self):
        """This module and every owned submodule, depth first, in attribute order."""
        yield self
        for _, child in self._children():
            if isinstance(child, Module):
                yield from child.modules()

    def named_parameters(self, prefix=""):
        """Yield (dotted_name, Parameter) for every owned Parameter, in a deterministic order.

        Each Parameter appears once (first name wins). Borrowed Parameters (in `shared_units`)
        are not listed.
        """
        seen = set()
        for name, p in self._named_parameters(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _named_parameters(self, prefix):
        for name, child in self._children():
            if isinstance(child, Parameter):
                yield prefix + name, child
            else:
                yield from child._named_parameters(f"{prefix}{name}.")

    def parameters(self):
        """List of owned Parameters, in `named_parameters` order."""
        return [p for _, p in self.named_parameters()]

    def num_parameters(self):
        """Number of owned parameter elements (tied weights counted once, by their owner)."""
        return sum(p.size for p in self.parameters())

    def zero_grad(self):
        """Fill every owned (non-released) grad with 0, in place."""
        for p in self.parameters():
            if p.grad is not None:
                p.grad.fill(0)

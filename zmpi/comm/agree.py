"""A call whose failure every rank learns: a check or a step that fails on some ranks only
must end every rank alike, or the ranks it passed on wait for ever in their next collective
with the ranks it failed on. One pickled allgather of what each rank has to say (None: all
well); the callers decide what to raise from it (zmpi.checkpoint.agreement.agree,
zmpi.engine.checks.agreed_across_stages)."""
from __future__ import annotations


def agreed_call(comm, fn, describe):
    """fn() on every rank of `comm` (a zmpi.comm.Comm), then one allgather. Returns
    (result, failed, error): this rank's result (None where fn raised); [(rank,
    describe(exception)), ...] for every rank whose fn raised, in rank order, the same list
    on every rank (`describe` returns something picklable and not None: only that travels);
    this rank's own exception, or None, to chain a raise from."""
    result, error, said = None, None, None
    try:
        result = fn()
    except Exception as e:  # handed to every rank below
        error, said = e, describe(e)
    failed = [(rank, s) for rank, s in enumerate(comm.allgather_object(said)) if s is not None]
    return result, failed, error

"""zmpi.nn.checks: the argument checks zmpi.nn's constructors share (the router's, the Llama
layers', GQA's, the sparsity configs' type test)."""
import numpy as np
import pytest

from zmpi.nn.checks import check_int, check_number, is_int


@pytest.mark.parametrize("value, least, ok", [
    (3, 1, True), (np.int64(3), 1, True), (0, 0, True), (0, 1, False), (True, 0, False),
    (2.0, 1, False), ("2", 1, False), (None, 0, False)])
def test_an_integer_is_an_int_or_numpy_integer_never_a_bool(value, least, ok):
    assert is_int(value, least) is ok
    if ok:
        assert check_int("n", value, least) == value and type(check_int("n", value, least)) is int
    else:
        with pytest.raises(ValueError, match=rf"^n must be an integer >= {least}, got "):
            check_int("n", value, least)


@pytest.mark.parametrize("value, strict, message", [
    (0.0, False, None), (np.float32(0.5), True, None), (2, True, None),
    (0, True, "must be a finite number > 0, got 0"), (-1e-9, False, ">= 0, got -1e-09"),
    (float("nan"), False, "got nan"), (float("inf"), False, "got inf"), (True, False, "got True"),
    ("1.0", False, "got '1.0'")])
def test_a_number_is_finite_real_and_not_a_bool(value, strict, message):
    if message is None:
        assert check_number("x", value, 0.0, strict) == float(value)
    else:
        with pytest.raises(ValueError, match=r"^x must be a finite number") as e:
            check_number("x", value, 0.0, strict)
        assert message in str(e.value)

"""tests/interpreter_speed.py changes only the Triton interpreter's bookkeeping: its memoized
numpy dtypes equal the interpreter's own answers."""

from __future__ import annotations

import pytest

from .conftest import needs_interpreter


@needs_interpreter
def test_memoized_numpy_dtypes_equal_the_interpreters():
    import triton.language as tl
    from triton.runtime import interpreter

    from .interpreter_speed import memoize_numpy_dtypes

    assert memoize_numpy_dtypes() and interpreter._get_np_dtype.memoized  # applied by conftest
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int32, tl.int64, tl.uint64, tl.float16, tl.bfloat16]
    scalars += [tl.float32, tl.float64, tl.float8e4nv]
    cases = [*scalars, tl.pointer_type(tl.float32), tl.block_type(tl.pointer_type(tl.int8), [4])]
    cases += [tl.block_type(t, shape) for t in scalars for shape in ([8], [2, 16])]
    unwrapped = interpreter._get_np_dtype.wrapped
    for _ in range(2):  # the first call fills the table, the second reads it
        for case in cases:
            assert interpreter._get_np_dtype(case) == unwrapped(case), case
    with pytest.raises(KeyError):
        interpreter._get_np_dtype(tl.void)

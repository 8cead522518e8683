"""tests/interpreter_speed.py changes only the Triton interpreter's bookkeeping: its memoized
numpy dtypes, shared block types and tensor shapes, skipped equal-shape broadcasts and identity
casts, and skipped overflow checks (only where they would be dropped) give what the
interpreter's own code gives. (Every interpreted test of the suite runs with them too.)"""

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


@needs_interpreter
def test_shared_block_types_and_shapes_equal_fresh_ones():
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    assert builder.get_block_ty.memoized and tl.tensor.__init__.memoized  # applied by conftest
    fresh_init = tl.tensor.__init__.wrapped
    for element in (tl.float32, tl.bfloat16, tl.int1, tl.pointer_type(tl.float32)):
        for shape in ([8], [2, 16], [2, 8], [1, 4, 1]):
            shared = builder.get_block_ty(None, element, shape)
            fresh = tl.block_type(element, shape)
            assert shared == fresh and shared.name == fresh.name and shared.numel == fresh.numel
            assert builder.get_block_ty(None, element, [tl.constexpr(d) for d in shape]) is shared
            assert fresh.with_element_ty(tl.int8) == tl.block_type(tl.int8, shape)
            for ty in (shared, element):
                for _ in range(2):  # the first tensor of a type keeps its shape for the next
                    made, want = tl.tensor(None, ty), tl.tensor.__new__(tl.tensor)
                    fresh_init(want, None, ty)
                    assert (made.shape, made.numel, made.type, made.dtype) == (
                        want.shape,
                        want.numel,
                        want.type,
                        want.dtype,
                    )
    # pointers to one element type in other address spaces or const are other types
    pointers = [
        tl.pointer_type(tl.float32, space, const)
        for space, const in (("global", False), ("shared", False), ("global", True))
    ]
    blocks = {id(builder.get_block_ty(None, p, [4])) for p in pointers}
    assert len(blocks) == 3


@needs_interpreter
def test_equal_shapes_skip_the_broadcast_and_others_still_broadcast():
    import numpy as np
    import triton.language as tl
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    semantic = interpreter.interpreter_semantic
    assert TritonSemantic.broadcast_impl_value.skips_equal_shapes  # applied by conftest

    def block(shape):
        data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        ty = tl.block_type(tl.float32, list(shape))
        return tl.tensor(interpreter.TensorHandle(data, tl.float32), ty)

    a, b = block((2, 4)), block((2, 4))
    assert semantic.broadcast_impl_value(a, b) == (a, b)
    for left, right in (((2, 1), (2, 4)), ((4,), (2, 4)), ((1, 4), (2, 1))):
        got = semantic.broadcast_impl_value(block(left), block(right))
        want = TritonSemantic.broadcast_impl_value.wrapped(semantic, block(left), block(right))
        for g, w in zip(got, want):
            assert list(g.shape) == list(w.shape) and np.array_equal(g.handle.data, w.handle.data)


@needs_interpreter
def test_overflow_checks_are_skipped_only_where_they_would_be_dropped():
    import dataclasses

    import numpy as np
    import triton.language as tl
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    assert TritonSemantic.binary_op_sanitize_overflow_impl.skips_discarded  # applied by conftest

    def semantic(debug):
        builder = interpreter.InterpreterBuilder()
        builder.options = dataclasses.replace(builder.options, debug=debug)
        return TritonSemantic(builder)

    def ints(values, dtype=tl.int32):
        data = np.array(values, dtype=interpreter._get_np_dtype(dtype))
        return tl.tensor(interpreter.TensorHandle(data, dtype), tl.block_type(dtype, [len(values)]))

    big, one = ints([2**31 - 1, 5]), ints([1, 1])
    quiet, checking = semantic(False), semantic(True)
    assert not interpreter.InterpreterBuilder().options.debug  # the interpreter never checks
    assert quiet.binary_op_sanitize_overflow_impl(big, one, quiet.add) is None
    with pytest.raises(AssertionError, match="int32 overflow detected for operation add"):
        checking.binary_op_sanitize_overflow_impl(big, one, checking.add)
    checking.binary_op_sanitize_overflow_impl(one, one, checking.add)  # in range: no error
    with pytest.raises(AssertionError, match="expected matching"):
        quiet.binary_op_sanitize_overflow_impl(big, ints([1, 1], tl.int16), quiet.add)


@needs_interpreter
def test_identity_casts_return_the_input_and_others_still_cast():
    import numpy as np
    import triton.language as tl
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    semantic = interpreter.interpreter_semantic
    assert TritonSemantic.cast.skips_identity  # applied by conftest
    data = np.array([1.5, -2.25, 3.0, 7.75], dtype=np.float32)
    x = tl.tensor(interpreter.TensorHandle(data, tl.float32), tl.block_type(tl.float32, [4]))
    assert semantic.cast(x, tl.float32) is x
    assert semantic.cast(x, tl.dtype("fp32")) is x  # an equal type object: the original's answer
    for dst in (tl.int32, tl.float16, tl.bfloat16):
        got = semantic.cast(x, dst)
        want = TritonSemantic.cast.wrapped(semantic, x, dst)
        assert got.type == want.type == tl.block_type(dst, [4])
        assert np.array_equal(got.handle.data, want.handle.data)

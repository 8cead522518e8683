"""The Triton interpreter's own bookkeeping, made cheaper for the suite (applied by
tests/conftest.py where TRITON_INTERPRET=1; tests/test_interpreter_speed.py checks each against
the interpreter's own code). An interpreted op spends ~150 us in Triton's semantic layer on type
and shape objects, not on the numpy work; these cut an interpreted test file's time by a third.
Each returns False, changing nothing, where Triton's layout is not the one it knows.

- `skip_nested_language_patches`: the interpreter re-patches `triton.language` on every call of
  a device function. Its kernel runner (`GridExecutor`) patches the language modules once per
  launch and restores them after; but each call of a `@triton.jit` helper from inside the kernel
  (kernels/rows.py's row helpers, the sampling select's bisection) patches them again, ~1 ms of
  `inspect.getmembers` per call whose scope is dropped unrestored. Under the interpreter a row
  kernel calls its helpers once per row and loop trip: in tests/test_sampling_replay.py that was
  a third of the run time.
- `memoize_numpy_dtypes`, `memoize_block_types`, `memoize_tensor_shapes`: objects that depend
  only on a dtype's name or a type are made once, not once per op.
- `skip_equal_shape_broadcasts`, `skip_identity_casts`: the broadcast of two blocks of one shape
  and the cast of a tensor to its own type, which do nothing.
- `skip_discarded_overflow_checks`: the int32 overflow check of every integer add / sub / mul,
  whose result the interpreter (never in debug mode) drops.
"""

from __future__ import annotations


class _NothingToRestore:
    def restore(self) -> None:
        pass


class _SeesBothModules:
    """What `_patch_lang` reads of a function (its globals), holding both language modules."""

    def __init__(self, language):
        self.__globals__ = {"language": language, "core": language.core}


def _replace(owner, name: str, flag: str, replacement) -> bool:
    """Put `replacement(original)` in place of `owner.name`, once (the replacement carries `flag`
    and `wrapped`, the original); False, changing nothing, where `owner` has no such attribute."""
    original = getattr(owner, name, None)
    if original is None:
        return False
    if not getattr(original, flag, False):
        patched = replacement(original)
        setattr(patched, flag, True)
        patched.wrapped = original
        setattr(owner, name, patched)
    return True


def skip_nested_language_patches() -> bool:
    """Patch triton.runtime.interpreter once per process: at each launch, both modules a helper
    can see (`triton.language` and `triton.language.core`, which triton.language.standard's
    helpers such as `tl.zeros` and `tl.sum` use) are patched, and both restored when the launch
    ends; a helper call inside the launch then skips its own patch, which would set the same
    attributes to the same objects (upstream patches no other module, and drops a helper's
    patches unrestored). False where its layout is unknown (another Triton): then nothing is
    changed."""
    try:
        import triton.language as language
        from triton.runtime import interpreter
    except ImportError:
        return False
    both = _SeesBothModules(language)
    launches: list[bool] = []  # a launch is running (GridExecutor restores its scope at its end)

    def replacement(original):
        def patch_lang(fn):
            if launches:  # a helper: upstream patches the language modules of its globals among
                return _NothingToRestore()  # these two, which the launch patched
            scope = original(both)
            launches.append(True)
            restore = scope.restore

            def restore_and_pop() -> None:
                launches.pop()
                restore()

            scope.restore = restore_and_pop
            return scope

        return patch_lang

    return _replace(interpreter, "_patch_lang", "skips_nested", replacement)


def memoize_numpy_dtypes() -> bool:
    """The interpreter's `_get_np_dtype` builds its 19-entry table of Triton -> numpy dtypes on
    every call (hashing each Triton dtype in Python): ~800k calls and ~7 % of an interpreted test
    file. Its answer depends only on the dtype's name (a block type's names its element type and
    shape), so it is looked up once per name. False where the layout is unknown."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False

    def replacement(original):
        by_name: dict = {}

        def get_np_dtype(tt_dtype):
            name = getattr(tt_dtype, "name", None)
            if not isinstance(name, str):
                return original(tt_dtype)
            found = by_name.get(name)
            if found is None:
                found = by_name[name] = original(tt_dtype)
            return found

        return get_np_dtype

    return _replace(interpreter, "_get_np_dtype", "memoized", replacement)


def skip_equal_shape_broadcasts() -> bool:
    """Every binary op of the interpreter passes its operands through the semantic layer's
    `broadcast_impl_value`, which rebuilds both block shapes as Triton tuples (constexpr types and
    all) before it finds, for operands of one shape, nothing to do: ~35 % of an interpreted op.
    Two blocks of equal shape are returned as they are, as that function returns them; every
    other case goes to it. False where the layout is unknown."""
    try:
        from triton.language.semantic import TritonSemantic
    except ImportError:
        return False

    def replacement(original):
        def broadcast_impl_value(self, lhs, rhs):
            lhs_ty, rhs_ty = lhs.type, rhs.type
            if lhs_ty.is_block() and rhs_ty.is_block():
                lhs_shape = getattr(lhs_ty.shape, "values", None)
                if lhs_shape is not None and lhs_shape == getattr(rhs_ty.shape, "values", None):
                    return lhs, rhs
            return original(self, lhs, rhs)

        return broadcast_impl_value

    return _replace(TritonSemantic, "broadcast_impl_value", "skips_equal_shapes", replacement)


def memoize_block_types() -> bool:
    """The interpreter builds a new `tl.block_type` (its shape a Triton tuple of constexpr types,
    its name formatted) for most ops' results: ~20 % of an interpreted op. A block type's fields
    are set once and never changed, so the interpreter's builder (`get_block_ty`) and
    `with_element_ty` return one instance per element type and shape. Pointer element types are
    told apart by address space and constness as well; any other element type is built anew.
    False where the layout is unknown."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None:
        return False

    def replacement(original):
        cache: dict = {}

        def block_type(element_ty, shape):
            if type(element_ty) is tl.dtype:
                kind = (element_ty.name,)
            elif type(element_ty) is tl.pointer_type and type(element_ty.element_ty) is tl.dtype:
                kind = (element_ty.name, element_ty.address_space, element_ty.const)
            else:
                return tl.block_type(element_ty, shape)
            dims = tuple(getattr(dim, "value", dim) for dim in shape)
            if not all(type(dim) is int for dim in dims):
                return tl.block_type(element_ty, shape)
            found = cache.get((kind, dims))
            if found is None:
                found = cache[(kind, dims)] = tl.block_type(element_ty, list(dims))
            return found

        def get_block_ty(self, dtype, shape):
            return block_type(dtype, shape)

        def with_element_ty(self, scalar_ty):
            return block_type(scalar_ty, self.shape)

        tl.block_type.with_element_ty = with_element_ty  # the same table for the semantic layer
        return get_block_ty

    return _replace(builder, "get_block_ty", "memoized", replacement)


def memoize_tensor_shapes() -> bool:
    """Every `tl.tensor` made by an interpreted op formats its shape anew from its type (a
    Triton tuple of constexprs, and the element count): ~15 % of an op once block types are
    shared (`memoize_block_types`). The shape and count depend only on the type and are never
    changed, so they are made once per type object and kept on it. False where the layout is
    unknown."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    if tl.tensor.__init__.__code__.co_varnames[:3] != ("self", "handle", "type"):
        return False

    def replacement(original):
        def __init__(self, handle, type):
            shape_and_numel = getattr(type, "_fusedrl_tensor_shape", None)
            if shape_and_numel is None:
                original(self, handle, type)
                type._fusedrl_tensor_shape = (self.shape, self.numel)
                return
            self.handle = handle
            self.shape, self.numel = shape_and_numel
            self.type = type
            self.dtype = type.scalar

        return __init__

    return _replace(tl.tensor, "__init__", "memoized", replacement)


def skip_discarded_overflow_checks() -> bool:
    """Every int32 add, sub and mul of the interpreter goes through the semantic layer's overflow
    sanitizer, which recomputes the op in int64, compares it with the bounds (five more ops) and
    hands the result to `device_assert`, which drops it unless the builder's options say debug:
    ~30 % of the interpreted ops of test_backends.py. The interpreter's options never do, so
    the check is skipped where `device_assert` would drop it (after the sanitizer's own type
    assertions); where debug is on, it runs as before. False where the layout is unknown."""
    try:
        from triton.language.semantic import TritonSemantic
    except ImportError:
        return False

    def replacement(original):
        def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op):
            options = self.builder.options
            if getattr(options, "debug", True) or not getattr(options, "sanitize_overflow", True):
                return original(self, lhs, rhs, binary_op)
            if lhs.type.scalar.int_bitwidth >= 64:
                return None
            lhs_ty, rhs_ty = lhs.type.scalar, rhs.type.scalar
            assert lhs_ty == rhs_ty, f"expected matching operand types, got {lhs_ty} and {rhs_ty}"
            assert lhs_ty.is_int(), f"expected integer type, got {lhs_ty}"
            return None

        return binary_op_sanitize_overflow_impl

    name = "binary_op_sanitize_overflow_impl"
    return _replace(TritonSemantic, name, "skips_discarded", replacement)


def skip_identity_casts() -> bool:
    """Every operand of an interpreted binary op is cast to the op's computation type, nearly
    always its own: `cast` finds that by comparing the two scalar types through `dtype.__eq__`
    (constexpr unwrapping, a name compare), ~1.7 M times in test_backends.py's Triton cases. A
    cast to the very same type object returns the input as `cast` itself does for equal types;
    every other cast goes to it. False where the layout is unknown."""
    try:
        from triton.language.semantic import TritonSemantic
    except ImportError:
        return False

    def replacement(original):
        def cast(self, input, dst_ty, fp_downcast_rounding=None):
            if fp_downcast_rounding is None and input.type.scalar is dst_ty.scalar:
                return input
            return original(self, input, dst_ty, fp_downcast_rounding)

        return cast

    return _replace(TritonSemantic, "cast", "skips_identity", replacement)

"""The Triton interpreter re-patches `triton.language` on every call of a device function.

Its kernel runner (`GridExecutor`) patches the language modules once per launch and restores them
after; but each call of a `@triton.jit` helper from inside the kernel (kernels/rows.py's row
helpers, the sampling select's bisection) patches them again, ~1 ms of `inspect.getmembers` per
call whose scope is dropped unrestored. Under the interpreter a row kernel calls its helpers once
per row and loop trip: in tests/test_sampling_replay.py that was a third of the run time.

`skip_nested_language_patches()` patches, at each launch, both modules a helper can see
(`triton.language` and `triton.language.core`, which triton.language.standard's helpers such as
`tl.zeros` and `tl.sum` use), and restores both when the launch ends; a helper call inside the
launch then skips its own patch, which would set the same attributes to the same objects
(upstream patches no other module, and drops a helper's patches unrestored). The kernels' results
are unchanged: this is only the interpreter's bookkeeping. Applied by tests/conftest.py where
TRITON_INTERPRET=1.
"""

from __future__ import annotations


class _NothingToRestore:
    def restore(self) -> None:
        pass


class _SeesBothModules:
    """What `_patch_lang` reads of a function (its globals), holding both language modules."""

    def __init__(self, language):
        self.__globals__ = {"language": language, "core": language.core}


def skip_nested_language_patches() -> bool:
    """Patch triton.runtime.interpreter once per process; False where its layout is unknown
    (another Triton): then nothing is changed."""
    try:
        import triton.language as language
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "skips_nested", False):
        return original is not None
    both = _SeesBothModules(language)
    launches: list[bool] = []  # a launch is running (GridExecutor restores its scope at its end)

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

    patch_lang.skips_nested = True
    interpreter._patch_lang = patch_lang
    return True


def memoize_numpy_dtypes() -> bool:
    """The interpreter's `_get_np_dtype` builds its 19-entry table of Triton -> numpy dtypes on
    every call (hashing each Triton dtype in Python): ~800k calls and ~7 % of an interpreted test
    file. Its answer depends only on the dtype's name (a block type's names its element type and
    shape), so it is looked up once per name. False where the layout is unknown."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "memoized", False):
        return original is not None
    by_name: dict = {}

    def get_np_dtype(tt_dtype):
        name = getattr(tt_dtype, "name", None)
        if not isinstance(name, str):
            return original(tt_dtype)
        found = by_name.get(name)
        if found is None:
            found = by_name[name] = original(tt_dtype)
        return found

    get_np_dtype.memoized, get_np_dtype.wrapped = True, original
    interpreter._get_np_dtype = get_np_dtype
    return True

"""The context layout comes from one source: the native library exports the
layout it was built with (csrc/runtime_state.h) and loading it checks that
against jaxtdist/language/_layout.py (jaxtdist/runtime/_native.py)."""

from __future__ import annotations

import types

import pytest

from jaxtdist.language import _layout
from jaxtdist.runtime import _native


def test_built_library_matches_layout():
    layout = _native.native().ctx_layout()
    assert {"CTX_WORDS", "CTX_EPOCH", "ERR_WORDS"} <= set(layout)
    for name, value in layout.items():
        assert getattr(_layout, name) == value, name
    assert _native.native().ctx_words == _layout.CTX_WORDS


def test_mismatch_is_an_import_error_naming_both_values(monkeypatch):
    monkeypatch.setattr(_layout, "CTX_WORDS", _layout.CTX_WORDS + 1)
    with pytest.raises(ImportError, match=r"stale build") as err:
        _native.check_layout(_native.native())
    msg = str(err.value)
    assert f"CTX_WORDS: native {_layout.CTX_WORDS - 1}" in msg
    assert f"_layout.py {_layout.CTX_WORDS}" in msg


def test_library_without_layout_is_stale():
    old = types.SimpleNamespace(__name__="jaxtdist._jaxtdist_ffi", __file__="/old/lib.so")
    with pytest.raises(ImportError, match=r"/old/lib.so predates ctx_layout\(\): a stale build"):
        _native.check_layout(old)


def test_native_refuses_a_stale_library(monkeypatch):
    """native() checks the layout before it registers any FFI target."""
    fake = types.SimpleNamespace(
        __name__="jaxtdist._jaxtdist_ffi", __file__="/stale/lib.so",
        ctx_layout=lambda: dict(CTX_WORDS=_layout.CTX_WORDS, CTX_EPOCH=_layout.CTX_EPOCH + 1),
        handlers=lambda: pytest.fail("registered handlers of a stale library"))
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_load", lambda: fake)
    want = rf"CTX_EPOCH: native {_layout.CTX_EPOCH + 1}, .*_layout.py {_layout.CTX_EPOCH}"
    with pytest.raises(ImportError, match=want):
        _native.native()
    assert _native._module is None

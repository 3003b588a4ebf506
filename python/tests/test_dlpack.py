# kiln.Tensor and numpy through DLPack: zero-copy round trips both ways (same address), every
# dtype (bf16 and float8 through ml_dtypes), views and strides, versioned and legacy capsules,
# the read-only flag, copy and dl_device, a capsule consumed twice or never, a freed producer,
# and bad input getting kiln's message.
import ctypes
import gc

import numpy as np
import pytest

import kiln
from kiln import _C

ml_dtypes = pytest.importorskip("ml_dtypes")

NUMPY_DTYPES = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_]
KILN_NAMES = {np.float64: "f64", np.float32: "f32", np.float16: "f16", np.int64: "i64", np.int32: "i32",
              np.int16: "i16", np.int8: "i8", np.uint8: "u8", np.bool_: "bool"}


def capsule_name(cap):
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype, get.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get(cap).decode()


def random_array(rng, shape, dtype):
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype_is_zero_copy(rng, dtype):
    a = random_array(rng, (3, 5, 7), dtype)
    t = kiln.from_dlpack(a)
    assert t.dtype == KILN_NAMES[dtype] and t.shape == [3, 5, 7] and t.device == "cpu"
    assert t.data_ptr == a.ctypes.data
    b = kiln.to_numpy(t)
    assert b.ctypes.data == a.ctypes.data and b.dtype == a.dtype
    np.testing.assert_array_equal(b, a)
    a.flat[4] = a.flat[5]  # the same memory: a write through numpy is seen by kiln
    assert b.flat[4] == a.flat[5]


@pytest.mark.parametrize("name,kiln_name", [("bfloat16", "bf16"), ("float8_e4m3fn", "f8_e4m3"),
                                            ("float8_e5m2", "f8_e5m2")])
def test_ml_dtypes_round_trip(rng, name, kiln_name):
    dt = getattr(ml_dtypes, name)
    a = rng.standard_normal((4, 9)).astype(dt)
    t = kiln.from_dlpack(a)
    assert t.dtype == kiln_name and t.data_ptr == a.ctypes.data
    b = kiln.to_numpy(t)
    assert b.dtype == dt and b.ctypes.data == a.ctypes.data
    np.testing.assert_array_equal(b.view(np.uint8), a.view(np.uint8))


def test_bf16_values_convert_as_kiln_computes_them(rng):
    a = rng.standard_normal((6, 5)).astype(np.float32)
    t = kiln.from_dlpack(a).to("bf16")
    b = kiln.to_numpy(t)
    np.testing.assert_array_equal(b, a.astype(ml_dtypes.bfloat16))  # round to nearest even, both
    np.testing.assert_array_equal(kiln.to_numpy(t.to("f32")), a.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_views_and_strides(rng):
    base = rng.standard_normal((6, 10)).astype(np.float32)
    for view in (base[::2, 1:], base.T, base[:, 3], base[1:4, ::3], base[None, 2:3, :]):
        t = kiln.from_dlpack(view)
        assert t.shape == list(view.shape)
        assert t.strides == [s // 4 for s in view.strides] or view.size <= 1
        assert t.data_ptr == view.ctypes.data
        back = kiln.to_numpy(t)
        assert back.ctypes.data == view.ctypes.data
        np.testing.assert_array_equal(back, view)
        np.testing.assert_array_equal(kiln.to_numpy(t.contiguous()), view)
    assert not kiln.from_dlpack(base.T).is_contiguous()


def test_empty_and_scalar_arrays():
    for a in (np.zeros((0, 3), np.float32), np.zeros((2, 0, 4), np.int64), np.array(3.5)):
        t = kiln.from_dlpack(a)
        assert t.shape == list(a.shape)
        np.testing.assert_array_equal(kiln.to_numpy(t), a)
    assert kiln.from_dlpack(np.array(3.5)).item() == 3.5


def test_versioned_and_legacy_capsules(rng):
    t = kiln.from_dlpack(rng.standard_normal(8).astype(np.float32)).clone()
    assert capsule_name(t.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
    assert capsule_name(t.__dlpack__(max_version=(1, 3))) == "dltensor_versioned"
    assert capsule_name(t.__dlpack__()) == "dltensor"
    assert capsule_name(t.__dlpack__(max_version=(0, 8))) == "dltensor"
    assert t.__dlpack_device__() == (1, 0)
    # kiln consumes both kinds
    a = rng.standard_normal(5)
    for cap in (a.__dlpack__(), a.__dlpack__(max_version=(1, 0))):
        k = kiln.from_dlpack(cap)
        assert k.data_ptr == a.ctypes.data
        assert capsule_name(cap).startswith("used_")


def test_capsule_consumed_twice_or_never(rng):
    a = rng.standard_normal(4)
    cap = a.__dlpack__(max_version=(1, 0))
    kiln.from_dlpack(cap)
    with pytest.raises(ValueError, match="consumed once"):
        kiln.from_dlpack(cap)
    # A capsule nobody consumes frees its tensor.
    gc.collect()
    before = kiln.memory_stats("cpu")["current_bytes"]
    t = kiln.from_dlpack(np.ones(1 << 16, np.float32)).clone()
    assert kiln.memory_stats("cpu")["current_bytes"] >= before + (1 << 18)
    caps = [t.__dlpack__(), t.__dlpack__(max_version=(1, 0))]
    del t
    assert kiln.memory_stats("cpu")["current_bytes"] >= before + (1 << 18)  # the capsules hold it
    del caps
    gc.collect()
    assert kiln.memory_stats("cpu")["current_bytes"] == before


def test_freed_producer_and_freed_consumer(rng):
    a = rng.standard_normal((50, 7))
    expected = a.copy()
    t = kiln.from_dlpack(a)
    del a
    gc.collect()
    junk = [np.full((50, 7), 9.0) for _ in range(8)]  # reuse of freed memory would show
    np.testing.assert_array_equal(kiln.to_numpy(t), expected)
    # numpy keeps a kiln tensor's memory alive too
    k = kiln.from_dlpack(expected).clone()
    ptr = k.data_ptr
    b = np.from_dlpack(k)
    del k, junk
    gc.collect()
    assert b.ctypes.data == ptr
    np.testing.assert_array_equal(b, expected)


def test_read_only_flag_travels(rng):
    a = rng.standard_normal(6)
    a.flags.writeable = False
    t = kiln.from_dlpack(a)
    assert t.read_only and t.data_ptr == a.ctypes.data
    b = np.from_dlpack(t)
    assert not b.flags.writeable and b.ctypes.data == a.ctypes.data
    # a pre-1.0 consumer has no read-only flag: it gets a copy, or an error with copy=False
    legacy = kiln.from_dlpack(t.__dlpack__())
    assert legacy.data_ptr != a.ctypes.data and not legacy.read_only
    with pytest.raises(BufferError, match="read-only"):
        t.__dlpack__(copy=False)
    w = kiln.from_dlpack(rng.standard_normal(3))
    assert not w.read_only and np.from_dlpack(w).flags.writeable


def test_copy_and_dl_device(rng):
    a = rng.standard_normal(10).astype(np.float32)
    t = kiln.from_dlpack(a)
    c = np.from_dlpack(t, copy=True)
    assert c.ctypes.data != a.ctypes.data
    np.testing.assert_array_equal(c, a)
    assert np.from_dlpack(t, copy=False).ctypes.data == a.ctypes.data
    assert np.from_dlpack(t, device="cpu").ctypes.data == a.ctypes.data
    k = kiln.from_dlpack(a, copy=True)
    assert k.data_ptr != a.ctypes.data
    np.testing.assert_array_equal(kiln.to_numpy(k), a)
    if not kiln.cuda_built():
        with pytest.raises(kiln.KilnError, match="cuda"):
            t.__dlpack__(max_version=(1, 0), dl_device=(2, 0))


def test_bad_input_gets_kilns_message(rng):
    with pytest.raises(TypeError, match="no __dlpack__"):
        kiln.from_dlpack([1, 2, 3])
    with pytest.raises(kiln.KilnError, match="has no kiln dtype"):
        kiln.from_dlpack(np.zeros(3, np.complex64))
    with pytest.raises(kiln.KilnError, match="has no kiln dtype"):
        kiln.from_dlpack(np.zeros(3, np.uint16))
    try:
        cap = np.arange(6.0)[::-1].__dlpack__()
    except BufferError:
        cap = None  # this numpy refuses to export negative strides itself
    if cap is not None:
        with pytest.raises(kiln.KilnError, match="negative strides"):
            kiln.from_dlpack(cap)
    with pytest.raises(kiln.KilnError, match="cannot be viewed"):
        kiln.from_dlpack(np.zeros(3, np.float32)).view_as("f16")

    class RequiresGrad:
        requires_grad = True

        def __dlpack__(self, **kw):
            raise AssertionError("not reached")

    with pytest.raises(kiln.KilnError, match="requires grad.*detach"):
        kiln.from_dlpack(RequiresGrad())
    with pytest.raises(TypeError, match="expected a kiln.Tensor"):
        kiln.to_numpy(np.zeros(2))

"""Tracing a Python score_mod / mask_mod into kiln's run-time mod expression language
(docs/jit.md), so kiln.torch takes the same function a user writes for PyTorch's flex_attention.

The function is called once with proxy objects for ``score, b, h, q_idx, kv_idx``; every
operation on a proxy builds the text of a C++ expression instead of computing a value. torch
functions (``torch.where``, ``torch.tanh``, ``torch.exp``, ...) reach the proxies through torch's
``__torch_function__`` protocol, and indexing a tensor the function captures (``bias[h]``,
``doc[q_idx]``) makes that tensor a capture of the mod, named after the variable that holds it.
What cannot be traced says why: Python control flow on a traced value (``if``, ``and``, ``or``,
``not``, ``bool()``, ``int()``) has no single expression, since the branch taken would depend
on data the trace does not have.
"""
import math
import struct

import torch

from .._C import KilnError

# Python's operators on ints follow floor semantics; C++'s truncate. These helpers keep Python's.
_FLOORDIV = "where(({a}) % ({b}) != 0 && ((({a}) < 0) != (({b}) < 0)), ({a}) / ({b}) - 1, ({a}) / ({b}))"
_MOD = "where(({a}) % ({b}) != 0 && ((({a}) % ({b}) < 0) != (({b}) < 0)), ({a}) % ({b}) + ({b}), ({a}) % ({b}))"
# The mods' index arguments: never negative (b < B, h < H, q_idx < L, kv_idx < S).
_INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")

_UNTRACEABLE = ("kiln.torch: the {what} cannot be traced: {why}. A traced mod runs as one expression over "
                "(score, b, h, q_idx, kv_idx) for every pair, so a branch that depends on those values has no "
                "single answer; write it with torch.where(cond, a, b), & (and), | (or) and ~ (not) instead")


class _Trace:
    """The captures met while tracing one function: tensor -> name, in order of first use."""

    def __init__(self, fn, what):
        self.what = what
        self.names = []
        self.tensors = []
        self._ids = {}
        # Names for captured tensors: the variable names that hold them (closure, then globals).
        self._pretty = {}
        code = getattr(fn, "__code__", None)
        if code is not None and getattr(fn, "__closure__", None):
            for var, cell in zip(code.co_freevars, fn.__closure__):
                try:
                    if isinstance(cell.cell_contents, torch.Tensor):
                        self._pretty.setdefault(id(cell.cell_contents), var)
                except ValueError:  # an empty cell
                    pass
        for var, value in getattr(fn, "__globals__", {}).items():
            if code is not None and var in code.co_names and isinstance(value, torch.Tensor):
                self._pretty.setdefault(id(value), var)

    def fail(self, why):
        raise KilnError(_UNTRACEABLE.format(what=self.what, why=why))

    def capture(self, t):
        key = id(t)
        if key in self._ids:
            return self._ids[key]
        if t.dim() < 1 or t.dim() > 4:
            raise KilnError(f"kiln.torch: the {self.what} indexes a captured tensor of {t.dim()} dims; captures "
                            f"have 1 to 4 (docs/jit.md)")
        if t.dtype not in (torch.float32, torch.int32, torch.int64):
            raise KilnError(f"kiln.torch: the {self.what} indexes a captured {t.dtype} tensor; captures are "
                            f"float32 (values) or int32 / int64 (ids)")
        base = self._pretty.get(key, "capture")
        reserved = {"score", "b", "h", "q_idx", "kv_idx", "q_len", "kv_len", "inf", "true", "false"}
        name = base if base not in reserved and base not in self.names and base.isidentifier() else None
        i = 0
        while name is None or name in self.names:
            name = f"{base}_{i}" if base.isidentifier() and base not in reserved else f"capture_{i}"
            i += 1
        self.names.append(name)
        self.tensors.append(t)
        self._ids[key] = name
        return name


def _literal(x, trace):
    """A Python number or bool as an expression of kind int, float or bool."""
    if isinstance(x, Proxy):
        return x
    if isinstance(x, bool):
        return Proxy("true" if x else "false", "bool", trace)
    if isinstance(x, int):
        if not -(2 ** 31) <= x < 2 ** 31:
            return Proxy(f"int64_t({x}LL)", "int", trace)
        return Proxy(str(x), "int", trace)
    if isinstance(x, float):
        if math.isnan(x):
            return Proxy("(inf - inf)", "float", trace)
        if math.isinf(x):
            return Proxy("inf" if x > 0 else "(-inf)", "float", trace)
        f32 = struct.unpack("f", struct.pack("f", x))[0]  # the kernels compute in float
        text = repr(f32)
        if "e" not in text and "." not in text:
            text += ".0"
        return Proxy(text + "f", "float", trace)
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        return _literal(x.item(), trace)
    trace.fail(f"it combines a traced value with a {type(x).__name__}, which has no expression")


def float_literal(x):
    """A float as the kernels' float literal (the value rounded to float32, written exactly)."""
    return _literal(float(x), None).text


def _kind2(a, b):
    return "float" if "float" in (a.kind, b.kind) else ("int" if "int" in (a.kind, b.kind) else "bool")


class Proxy:
    """A traced value: the text of a C++ expression and its kind (int, float or bool)."""

    __slots__ = ("text", "kind", "trace")

    def __init__(self, text, kind, trace):
        self.text, self.kind, self.trace = text, kind, trace

    # ---- what tracing cannot do
    def __bool__(self):
        self.trace.fail(f"its Python control flow (if / and / or / not / bool()) depends on the traced value "
                        f"`{self.text}`")

    def __index__(self):
        self.trace.fail(f"it uses the traced value `{self.text}` as a Python int (an index into a list, range(), "
                        f"int())")

    __int__ = __index__

    def __float__(self):
        self.trace.fail(f"it converts the traced value `{self.text}` to a Python float")

    def __iter__(self):
        self.trace.fail(f"it iterates over the traced value `{self.text}`")

    def __repr__(self):
        return f"<traced {self.kind}: {self.text}>"

    # ---- arithmetic
    def _bin(self, other, op, reverse=False):
        o = _literal(other, self.trace)
        a, b = (o, self) if reverse else (self, o)
        kind = _kind2(a, b)
        if kind == "bool":
            kind = "int"  # bool arithmetic promotes, as in Python
        return Proxy(f"({a.text} {op} {b.text})", kind, self.trace)

    def __add__(self, o): return self._bin(o, "+")
    def __radd__(self, o): return self._bin(o, "+", True)
    def __sub__(self, o): return self._bin(o, "-")
    def __rsub__(self, o): return self._bin(o, "-", True)
    def __mul__(self, o): return self._bin(o, "*")
    def __rmul__(self, o): return self._bin(o, "*", True)

    def _truediv(self, other, reverse):
        o = _literal(other, self.trace)
        a, b = (o, self) if reverse else (self, o)
        at = a.text if a.kind == "float" else f"float({a.text})"  # Python's / is true division
        return Proxy(f"({at} / {b.text})", "float", self.trace)

    def __truediv__(self, o): return self._truediv(o, False)
    def __rtruediv__(self, o): return self._truediv(o, True)

    def _intop(self, other, template, op, reverse):
        o = _literal(other, self.trace)
        a, b = (o, self) if reverse else (self, o)
        if a.kind == "float" or b.kind == "float":
            self.trace.fail(f"`{op}` of a float has no expression in kiln's mod language (use torch.floor or write "
                            f"it another way)")
        if a.text in _INDEX_NAMES and b.text.isdigit() and int(b.text) > 0:
            # An index (never negative) over a positive constant: C++'s / and % already floor, so
            # the plain operator (a shift or a multiply in the kernels) replaces the sign fix-up.
            return Proxy(f"({a.text} {'/' if op == '//' else '%'} {b.text})", "int", self.trace)
        return Proxy("(" + template.format(a=a.text, b=b.text) + ")", "int", self.trace)

    def __floordiv__(self, o): return self._intop(o, _FLOORDIV, "//", False)
    def __rfloordiv__(self, o): return self._intop(o, _FLOORDIV, "//", True)
    def __mod__(self, o): return self._intop(o, _MOD, "%", False)
    def __rmod__(self, o): return self._intop(o, _MOD, "%", True)

    def __pow__(self, o):
        o = _literal(o, self.trace)
        if o.text == "2" or o.text == "2.0f":
            return Proxy(f"({self.text} * {self.text})", "float" if self.kind == "float" else self.kind, self.trace)
        return Proxy(f"pow({self._f()}, {o._f()})", "float", self.trace)

    def __neg__(self): return Proxy(f"(-{self.text})", "int" if self.kind == "bool" else self.kind, self.trace)
    def __pos__(self): return self
    def __abs__(self): return Proxy(f"abs({self.text})", self.kind, self.trace)

    def _f(self):
        return self.text if self.kind == "float" else f"float({self.text})"

    # ---- comparisons (a chain such as a < b < c calls __bool__, which says so)
    def _cmp(self, other, op):
        o = _literal(other, self.trace)
        return Proxy(f"({self.text} {op} {o.text})", "bool", self.trace)

    def __lt__(self, o): return self._cmp(o, "<")
    def __le__(self, o): return self._cmp(o, "<=")
    def __gt__(self, o): return self._cmp(o, ">")
    def __ge__(self, o): return self._cmp(o, ">=")
    def __eq__(self, o): return self._cmp(o, "==")
    def __ne__(self, o): return self._cmp(o, "!=")
    __hash__ = None

    # ---- logic: & | ^ ~ on bools (as torch's masks write them), bitwise on ints
    def _logic(self, other, bool_op, int_op, reverse=False):
        o = _literal(other, self.trace)
        a, b = (o, self) if reverse else (self, o)
        if a.kind == "bool" and b.kind == "bool":
            return Proxy(f"({a.text} {bool_op} {b.text})", "bool", self.trace)
        if a.kind == "float" or b.kind == "float":
            self.trace.fail(f"`{int_op}` of a float")
        return Proxy(f"({a.text} {int_op} {b.text})", "int", self.trace)

    def __and__(self, o): return self._logic(o, "&&", "&")
    def __rand__(self, o): return self._logic(o, "&&", "&", True)
    def __or__(self, o): return self._logic(o, "||", "|")
    def __ror__(self, o): return self._logic(o, "||", "|", True)
    def __xor__(self, o): return self._logic(o, "!=", "^")
    def __rxor__(self, o): return self._logic(o, "!=", "^", True)

    def __invert__(self):
        if self.kind == "bool":
            return Proxy(f"(!{self.text})", "bool", self.trace)
        return Proxy(f"(~{self.text})", "int", self.trace)

    # ---- tensor-style methods
    def logical_and(self, o): return _as_bool(self) & _as_bool(_literal(o, self.trace))
    def logical_or(self, o): return _as_bool(self) | _as_bool(_literal(o, self.trace))
    def logical_not(self): return ~_as_bool(self)
    def float(self): return Proxy(self._f(), "float", self.trace)
    def int(self): return Proxy(f"int({self.text})", "int", self.trace)
    def long(self): return Proxy(f"int64_t({self.text})", "int", self.trace)
    def bool(self): return _as_bool(self)
    def to(self, dtype): return _cast(self, dtype)
    def abs(self): return abs(self)
    def tanh(self): return _call1("tanh", self)
    def exp(self): return _call1("exp", self)
    def log(self): return _call1("log", self)
    def sqrt(self): return _call1("sqrt", self)
    def rsqrt(self): return _call1("rsqrt", self)
    def sigmoid(self): return _call1("sigmoid", self)
    def sin(self): return _call1("sin", self)
    def cos(self): return _call1("cos", self)
    def clamp(self, min=None, max=None): return _clamp(self, min, max)

    # ---- torch functions on proxies (torch.where, torch.tanh, tensor[proxy], ...)
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trace = next(a.trace for a in _flat(args, kwargs) if isinstance(a, Proxy))
        handler = _TORCH.get(func)
        if handler is None:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            trace.fail(f"it calls torch's {name}, which has no expression in kiln's mod language (supported: "
                       f"{', '.join(sorted(_TORCH_NAMES))}, indexing a captured tensor, arithmetic, comparisons, "
                       f"& | ~)")
        return handler(trace, *args, **kwargs)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (tuple, list)):
            yield from a
        else:
            yield a


def _as_bool(p):
    return p if p.kind == "bool" else Proxy(f"bool({p.text})", "bool", p.trace)


def _call1(fn, x):
    return Proxy(f"{fn}({x._f()})", "float", x.trace)


def _cast(p, dtype):
    if dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, float):
        return p.float()
    if dtype in (torch.int32, torch.int64, torch.int16, int):
        return Proxy(f"int64_t({p.text})", "int", p.trace)
    if dtype in (torch.bool, bool):
        return _as_bool(p)
    p.trace.fail(f"it casts to {dtype}")


def _clamp(x, lo, hi):
    out = x
    if lo is not None:
        lo = _literal(lo, x.trace)
        out = Proxy(f"max({out._f()}, {lo._f()})", "float", x.trace)
    if hi is not None:
        hi = _literal(hi, x.trace)
        out = Proxy(f"min({out._f()}, {hi._f()})", "float", x.trace)
    return out


def _where(trace, cond, a, b):
    c, a, b = _literal(cond, trace), _literal(a, trace), _literal(b, trace)
    kind = _kind2(a, b)
    if kind == "float":
        return Proxy(f"where({_as_bool(c).text}, {a._f()}, {b._f()})", "float", trace)
    return Proxy(f"where({_as_bool(c).text}, {a.text}, {b.text})", kind, trace)


def _minmax(fn):
    def h(trace, a, b, **_):
        a, b = _literal(a, trace), _literal(b, trace)
        if "float" in (a.kind, b.kind):
            return Proxy(f"{fn}({a._f()}, {b._f()})", "float", trace)
        return Proxy(f"{fn}({a.text}, {b.text})", "int", trace)
    return h


def _getitem(trace, t, index):
    if isinstance(t, Proxy):
        trace.fail(f"it indexes the traced value `{t.text}`")
    if not isinstance(t, torch.Tensor):
        trace.fail(f"it indexes a {type(t).__name__} with a traced value")
    index = index if isinstance(index, tuple) else (index,)
    if len(index) != t.dim():
        raise KilnError(f"kiln.torch: the {trace.what} indexes a captured tensor of shape {tuple(t.shape)} with "
                        f"{len(index)} indices; a capture is read one element at a time (one index per dim)")
    name = trace.capture(t)
    text = name + "".join(f"[{_literal(i, trace).text}]" for i in index)
    return Proxy(text, "float" if t.dtype.is_floating_point else "int", trace)


def _unary(fn):
    return lambda trace, x, *a, **k: _call1(fn, _literal(x, trace))


_TORCH = {
    torch.where: _where,
    torch.tanh: _unary("tanh"), torch.exp: _unary("exp"), torch.log: _unary("log"), torch.sqrt: _unary("sqrt"),
    torch.rsqrt: _unary("rsqrt"), torch.sigmoid: _unary("sigmoid"), torch.sin: _unary("sin"),
    torch.cos: _unary("cos"),
    torch.abs: lambda trace, x, **_: abs(_literal(x, trace)),
    torch.minimum: _minmax("min"), torch.maximum: _minmax("max"),
    torch.clamp: lambda trace, x, min=None, max=None: _clamp(_literal(x, trace), min, max),
    torch.logical_and: lambda trace, a, b: _as_bool(_literal(a, trace)) & _as_bool(_literal(b, trace)),
    torch.logical_or: lambda trace, a, b: _as_bool(_literal(a, trace)) | _as_bool(_literal(b, trace)),
    torch.logical_not: lambda trace, a: ~_as_bool(_literal(a, trace)),
    torch.Tensor.__getitem__: _getitem,
}
# what tensor[proxy] dispatches as (torch._C.TensorBase; _TensorBase in older torch)
_TORCH[getattr(torch._C, "TensorBase", getattr(torch._C, "_TensorBase", torch.Tensor)).__getitem__] = _getitem
for _name, _fn in (("tanh", "tanh"), ("exp", "exp"), ("log", "log"), ("sqrt", "sqrt"), ("rsqrt", "rsqrt"),
                   ("sigmoid", "sigmoid"), ("sin", "sin"), ("cos", "cos")):
    _TORCH[getattr(torch.Tensor, _name)] = _unary(_fn)
_TORCH_NAMES = {"torch.where", "tanh", "exp", "log", "sqrt", "rsqrt", "sigmoid", "sin", "cos", "abs", "minimum",
                "maximum", "clamp", "logical_and / or / not"}


def trace_mod(fn, kind):
    """(expression, capture names, capture tensors) of a Python score_mod (kind "score_mod":
    fn(score, b, h, q_idx, kv_idx)) or mask_mod (fn(b, h, q_idx, kv_idx))."""
    t = _Trace(fn, kind)
    args = [Proxy("b", "int", t), Proxy("h", "int", t), Proxy("q_idx", "int", t), Proxy("kv_idx", "int", t)]
    if kind == "score_mod":
        args.insert(0, Proxy("score", "float", t))
    try:
        out = fn(*args)
    except KilnError:
        raise
    except TypeError as e:
        raise KilnError(f"kiln.torch: the {kind} cannot be traced: calling it with traced values raised "
                        f"TypeError: {e}") from e
    out = _literal(out, t)
    if kind == "mask_mod":
        out = _as_bool(out)
    else:
        out = Proxy(out._f(), "float", t)
    text = out.text
    # the outer parentheses carry nothing
    if text.startswith("(") and text.endswith(")") and _balanced(text[1:-1]):
        text = text[1:-1]
    return text, t.names, t.tensors


def _balanced(s):
    depth = 0
    for c in s:
        depth += c == "("
        depth -= c == ")"
        if depth < 0:
            return False
    return depth == 0

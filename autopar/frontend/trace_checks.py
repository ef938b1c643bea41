"""What the front end checks while tracing, and how it reports a failure in the user's terms.

- ``_check_arguments``: the example inputs must bind to ``model.forward``.
- ``_AutogradFunctionWatch``: user ``torch.autograd.Function``s applied while tracing (the
  tracers inline their forward and drop their backward; see the class).
- ``_quiet_torch_logs``: torch's own logging held back while tracing, replayed on success.
- ``_trace_error``: a failed trace becomes one ``TraceError`` naming the module, the user's
  source line and what to change.
"""
from __future__ import annotations

import inspect
import math
import os
import traceback

import torch
import torch.nn as nn

from autopar.errors import TraceError

_TORCH_DIR = os.path.dirname(torch.__file__)
# The front end's own files are not "user code" in a traceback.
_OWN_FILES = {os.path.join(os.path.dirname(os.path.abspath(__file__)), f) for f in ("trace.py", "trace_checks.py")}


class _quiet_torch_logs:
    """torch.export logs warnings and prints the partial graph to stderr (twice: once per front
    end) when tracing fails on a data-dependent branch; autopar's TraceError already says where and
    what to do. While tracing, torch's loggers are held at ERROR and stderr is captured: replayed
    as it was when tracing succeeds (nothing is lost), dropped when a TraceError replaces it."""

    def __enter__(self):
        import io
        import logging
        import sys

        self.saved = {}
        for name in ("torch", "torch.fx", "torch._dynamo", "torch.export", "torch.fx.experimental.symbolic_shapes"):
            log = logging.getLogger(name)
            self.saved[name] = log.level
            log.setLevel(logging.ERROR)
        self.stderr, self.buffer = sys.stderr, io.StringIO()
        sys.stderr = self.buffer
        return self

    def __exit__(self, exc_type, *exc):
        import logging
        import sys

        sys.stderr = self.stderr
        if exc_type is None and self.buffer.getvalue():
            self.stderr.write(self.buffer.getvalue())
        for name, level in self.saved.items():
            logging.getLogger(name).setLevel(level)
        return False


def _check_arguments(model: nn.Module, inputs: tuple) -> None:
    """The example inputs must bind to model.forward's parameters: say which is missing or extra,
    in the user's terms, before a tracer reports it from deep inside inspect.py."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*inputs)
    except TypeError as e:
        names = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        raise TraceError(f"the example inputs do not match {type(model).__name__}.forward({', '.join(names)}): "
                         f"{e} (got {len(inputs)} input{'s' if len(inputs) != 1 else ''}). Pass one tensor per "
                         f"argument of forward, in order; targets for a loss go to forward too, or use "
                         f"loss_fn=...") from None


def _is_torch_module(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


class _AutogradFunctionWatch:
    """Records every user-defined ``torch.autograd.Function`` applied while tracing.

    Both front ends trace THROUGH a custom Function: torch.export (non-strict, torch 2.13) and
    make_fx inline its forward as plain ATen ops and drop its backward, so autopar would train
    with the gradient of those ops, not the user's ``backward`` — silently. autopar cannot run a
    user's backward inside a generated program yet, so tracing refuses such a model with a
    TraceError naming the Function and the module that calls it. Functions defined inside torch
    are not reported: their forward is what their ATen decomposition differentiates.
    ``Function.apply`` (a classmethod every subclass inherits) is wrapped for the duration only.
    """

    def __init__(self, root: nn.Module, prefix: str):
        self.names = {id(m): (_strip(n, prefix) if prefix else n) for n, m in root.named_modules()}
        self.calls: dict[str, str] = {}   # "pkg.mod.Class" -> "module fqn (ModuleClass)"
        self.examples: dict[str, tuple] = {}   # "pkg.mod.Class" -> (class, argument shapes, kwargs)

    def unverified(self) -> dict[str, str]:
        """The recorded Functions whose backward is NOT the gradient of their forward's ops (checked
        numerically, ``_backward_matches_forward``): those tracing would silently change."""
        return {k: v for k, v in self.calls.items() if not _backward_matches_forward(*self.examples[k])}

    def __enter__(self):
        from torch.autograd.function import Function

        self._fn_cls = Function
        self._orig = Function.__dict__["apply"]
        original = self._orig.__func__
        watch = self

        def apply(cls, *args, **kwargs):
            if not _is_torch_module(cls.__module__ or ""):
                key = f"{cls.__module__}.{cls.__qualname__}"
                if key not in watch.calls:
                    watch.calls[key] = watch._caller_module()
                shapes = _shapes_of(args)
                # symbolic_trace calls it with Proxies first: keep a call that had real tensor shapes
                if key not in watch.examples or not _has_tensor(watch.examples[key][1]):
                    watch.examples[key] = (cls, shapes, dict(kwargs))
            return original(cls, *args, **kwargs)

        Function.apply = classmethod(apply)
        return self

    def __exit__(self, *exc):
        self._fn_cls.apply = self._orig
        return False

    def _caller_module(self) -> str:
        """The innermost module of the traced model on the Python stack ("<root>" for the root)."""
        frame = inspect.currentframe()
        while frame is not None:
            code = frame.f_code
            obj = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            if isinstance(obj, nn.Module) and id(obj) in self.names:
                return f"{self.names[id(obj)] or '<root>'} ({type(obj).__name__})"
            frame = frame.f_back
        return "<unknown module>"

    def error(self, model: nn.Module, calls: dict[str, str]) -> TraceError:
        found = "; ".join(f"{fn} called in module {mod}" for fn, mod in calls.items())
        return TraceError(f"{type(model).__name__} uses a custom torch.autograd.Function ({found}) whose backward "
                          f"is not the gradient of its forward: tracing inlines the forward and would train with "
                          f"the gradient of the traced ops instead of that backward, diverging from eager. "
                          f"autopar cannot keep a custom backward: write "
                          f"the op with differentiable torch ops (its backward then follows), or keep the "
                          f"Function out of the model you hand to autopar")


def _has_tensor(shapes) -> bool:
    return any(kind == "tensor" for kind, *_ in shapes)


def _shapes_of(args) -> list:
    """Tensor arguments as (shape, dtype) (fake/meta values cannot be computed with), others as-is."""
    return [("tensor", tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else ("value", a) for a in args]


class _Ctx:
    """A stand-in ``ctx`` for calling an old-style ``forward(ctx, ...)`` directly (no custom backward)."""

    def __init__(self):
        self.needs_input_grad = ()
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_dirty(self, *a):
        pass

    def mark_non_differentiable(self, *a):
        pass

    def set_materialize_grads(self, *a):
        pass


def _backward_matches_forward(cls, shapes, kwargs, elements: int = 1 << 16) -> bool:
    """Whether ``cls``'s own backward equals autograd's gradient of its forward's ops on random
    inputs of the traced shapes (dims clipped to 64 when a tensor is large: a Function that cannot
    take other sizes is then reported, the safe side). True means tracing through the Function
    (inlining its forward) trains exactly like eager; e.g. Bloom's tanh-GeLU Function, whose backward
    is the derivative of its forward, passes; one that returns some other gradient does not."""
    try:
        gen = torch.Generator().manual_seed(0)
        args = []
        for kind, *rest in shapes:
            if kind == "value":
                args.append(rest[0])
                continue
            shape, dtype = rest
            if math.prod(shape) > elements:
                shape = tuple(min(int(d), 64) for d in shape)
            if dtype.is_floating_point:
                args.append((torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_(True))
            else:
                args.append(torch.randint(0, 2, shape, generator=gen).to(dtype))
        floats = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not floats:
            return False   # no tensor shapes were seen (e.g. only Proxies): cannot check, so refuse
        own = cls.apply(*args, **kwargs)
        outs = [o for o in (own if isinstance(own, tuple) else (own,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        g_own = torch.autograd.grad(outs, floats, weights, allow_unused=True)
        plain_args = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.requires_grad else a
                      for a in args]
        if ("ctx" in inspect.signature(cls.forward).parameters
                or len(inspect.signature(cls.forward).parameters) > len(args)):
            plain = cls.forward(_Ctx(), *plain_args, **kwargs)
        else:
            plain = cls.forward(*plain_args, **kwargs)
        pouts = [o for o in (plain if isinstance(plain, tuple) else (plain,))
                 if isinstance(o, torch.Tensor) and o.requires_grad]
        pfloats = [a for a in plain_args if isinstance(a, torch.Tensor) and a.requires_grad]
        g_plain = torch.autograd.grad(pouts, pfloats, weights, allow_unused=True)
        for a, b in zip(g_own, g_plain):
            a = torch.zeros(()) if a is None else a
            b = torch.zeros(()) if b is None else b
            if not torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-6):
                return False
        return True
    except Exception:   # could not check: refuse rather than risk a silently different gradient
        return False


def _strip(fqn: str, prefix: str) -> str:
    return fqn[len(prefix):] if fqn.startswith(prefix) else ("" if fqn == prefix[:-1] else fqn)




# Errors that point at the user's code


def _user_frames(exc: BaseException):
    """(FrameSummary, frame) pairs of user code in the traceback of exc and its causes, outermost
    first. User code: not torch, not this file, not a synthesized '<string>' frame."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            fname = os.path.abspath(frame.f_code.co_filename)
            if fname.startswith(_TORCH_DIR) or fname in _OWN_FILES or fname.startswith("<"):
                continue
            out.append((fname, lineno, frame))
        exc = exc.__cause__ or exc.__context__
    return out


def _trace_error(model: nn.Module, root: nn.Module, errors: list[BaseException], prefix: str) -> TraceError:
    names = {id(m): _strip(n, prefix) if prefix else n for n, m in root.named_modules()}
    where, module = None, None
    for err in errors:
        frames = _user_frames(err)
        if not frames:
            continue
        fname, lineno, _ = frames[-1]   # innermost user frame: where tracing failed
        where = f"{fname}:{lineno}"
        # The innermost user frame that is a method of one of the model's modules names it.
        for _, _, frame in reversed(frames):
            code = frame.f_code   # the method's first argument, whatever it is called ("self")
            obj = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            if isinstance(obj, nn.Module) and id(obj) in names:
                fqn = names[id(obj)]
                module = f"{fqn or '<root>'} ({type(obj).__name__})"
                break
        break
    msgs = "; ".join(f"{type(e).__name__}: {_headline(e)}" for e in errors)
    text = " ".join(msgs.split())
    data_dependent = any(s in text for s in ("data-dependent", "data dependent", "control flow",
                                              "GuardOnDataDependent", "symbolically traced variables"))
    if data_dependent:
        fix = ("the forward branches on tensor values (e.g. `if x.sum() > 0:`): use torch.cond / "
               "torch.where, or move the decision out of forward")
    else:
        fix = ("make forward traceable by torch.export (no Python side effects on tensor values, "
               "plain tensor inputs), or pass loss_fn=... if forward does not return the loss")
    return TraceError(f"could not trace {type(model).__name__}: failed in module "
                      f"{module or '<unknown>'} at {where or '<unknown location>'}: {msgs}. To fix: {fix}")


def _headline(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # torch appends boilerplate (debugging links, C++ hints) after the error itself: keep its
    # first non-empty line, which states what went wrong.
    return lines[0] if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------

"""The front end: turn an ``nn.Module`` and one example batch into an ATen-level fx graph of
the training forward (ending in the scalar loss), with everything later stages need to know
about it.

``trace(model, example_inputs, loss_fn=None) -> TracedGraph``

- ``torch.export.export(strict=False)`` first. Its training IR keeps high-level ATen ops
  (aten.linear, aten.layer_norm, aten.scaled_dot_product_attention, aten.cross_entropy_loss,
  aten.embedding, ...), lifts parameters and buffers to placeholders and puts a FakeTensor in
  every node's ``meta["val"]``. It works on meta-device models without allocating.
- If export fails: ``torch.fx.symbolic_trace`` as a cheap check, then ``make_fx`` with
  ``pre_dispatch=True`` over ``torch.func.functional_call`` on fake tensors, which yields the
  same op vocabulary and placeholder order (no ``nn_module_stack``: no blocks on that path).
- If both fail: ``TraceError`` naming the module (FQN and class) and the user source line
  found in the exception's traceback, with what to change.

The TracedGraph also carries tied weights, a structural fingerprint (a plan records it so it
cannot run on another model) and the repeated blocks (groups of structurally identical
children of an ``nn.ModuleList``/``nn.Sequential``), which the solver solves once per group.
"""
from __future__ import annotations

import hashlib
import math
import inspect
import os
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from autopar.errors import TraceError

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@dataclass
class BlockGroup:
    """Structurally identical repeats of one block. ``instances[i][p]`` is the name of the node
    at position ``p`` of instance ``i``; position p does the same op on the same shapes in
    every instance, and edges inside an instance correspond position by position."""
    name: str                    # container FQN ("blocks", "transformer.h"), "#k" if it has several groups
    instances: list[list[str]]
    module_fqns: list[str] = field(default_factory=list)   # the child module of each instance ("blocks.3")


@dataclass
class TracedGraph:
    gm: GraphModule                      # placeholders: params/buffers, then user inputs; output: the loss
    param_fqn: dict[str, str]            # placeholder name -> FQN (parameters and buffers)
    buffers: set[str]                    # placeholder names that are not trained: buffers, lifted
                                         # constants, frozen parameters (requires_grad=False)
    tied: dict[str, list[str]]           # every FQN of a shared tensor -> all its FQNs (the one in param_fqn first)
    input_names: list[str]               # placeholder names of the user inputs, in order
    output_name: str                     # node whose value is the scalar loss
    source: str                          # "export" | "fx"
    trace_seconds: float
    fingerprint: str
    blocks: list[BlockGroup]
    block_of: dict[str, tuple[int, int, int]]   # node name -> (group, instance, position)
    # Tensors torch.export lifted out of the code (InputKind.CONSTANT_TENSOR: a plain tensor
    # attribute such as Falcon's rotary tables): FQN -> value. They are no module attribute
    # the model can be asked for ("...lifted_tensor_0"); their values live only here.
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)   # placeholder names of frozen parameters (also in buffers)

    def value_of(self, model: nn.Module, fqn: str) -> torch.Tensor:
        """The tensor behind a parameter/buffer/constant FQN: lifted constants from the export,
        everything else from the model."""
        if fqn in self.constants:
            return self.constants[fqn]
        obj = model
        for part in fqn.split("."):
            obj = getattr(obj, part)
        return obj

    def module_of(self, node: Node | str) -> str:
        """FQN of the innermost module that produced ``node`` ("" for the root or unknown)."""
        if isinstance(node, str):
            node = _node_by_name(self.gm, node)
        stack = node.meta.get("nn_module_stack") or {}
        return _strip_call_suffix(list(stack.values())[-1][0]) if stack else ""

    def nodes(self, op: str = "call_function") -> list[Node]:
        return [n for n in self.gm.graph.nodes if n.op == op]


def _node_by_name(gm: GraphModule, name: str) -> Node:
    for n in gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(f"no node named {name!r} in the traced graph")


def _strip_call_suffix(fqn: str) -> str:
    # A module called twice appears as "blocks.0@1" for its second call.
    return fqn.split("@")[0]


# ---------------------------------------------------------------------------------------------
# Entry point


class _LossWrapper(nn.Module):
    """``forward(*inputs) = loss_fn(model(*inputs[:k]), *inputs[k:])``. The model is registered
    as ``model``; that prefix is stripped from every FQN afterwards."""

    def __init__(self, model: nn.Module, loss_fn, k: int):
        super().__init__()
        self.model, self.loss_fn, self.k = model, loss_fn, k

    def forward(self, *inputs):
        return self.loss_fn(self.model(*inputs[:self.k]), *inputs[self.k:])


def _num_model_args(model: nn.Module, n_inputs: int) -> int:
    """Positional parameters of model.forward without defaults, capped at ``n_inputs``."""
    params = inspect.signature(model.forward).parameters.values()
    k = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty)
    return min(k, n_inputs)


def trace(model: nn.Module, example_inputs: tuple, loss_fn=None, *, frontend: str = "auto") -> TracedGraph:
    """Trace ``model`` on ``example_inputs`` (real or meta tensors) into a TracedGraph.

    With ``loss_fn`` the traced function is ``loss_fn(model(*inputs[:k]), *inputs[k:])`` where k
    is the number of required positional parameters of ``model.forward``; without it,
    ``model(*inputs)`` must return the scalar loss. ``frontend``: "auto" (export, then fx),
    "export" or "fx" (mostly for tests).
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if frontend not in ("auto", "export", "fx"):
        raise TraceError(f"frontend must be 'auto', 'export' or 'fx', got {frontend!r}")
    prefix = ""
    root = model
    if loss_fn is not None:
        root = _LossWrapper(model, loss_fn, _num_model_args(model, len(example_inputs)))
        prefix = "model."

    _check_arguments(model, example_inputs if loss_fn is None else
                     example_inputs[:_num_model_args(model, len(example_inputs))])
    t0 = time.perf_counter()
    with _AutogradFunctionWatch(root, prefix) as custom:
        result = _run_front_ends(model, root, example_inputs, frontend, prefix)
    if custom.calls:
        bad = custom.unverified()
        if bad:
            raise custom.error(model, bad)
    gm, param_fqn, buffers, input_names, output_name, source, constants = result
    seconds = time.perf_counter() - t0
    frozen = _frozen_params(root, param_fqn, buffers)
    buffers |= frozen

    if prefix:
        param_fqn = {k: _strip(v, prefix) for k, v in param_fqn.items()}
        constants = {_strip(k, prefix): v for k, v in constants.items()}
        _strip_module_stacks(gm, prefix)
    _check_scalar_loss(gm, output_name, loss_fn)
    tied = _tied_fqns(model)
    _drop_unused_tied_placeholders(gm, param_fqn, buffers, tied)
    blocks, block_of = find_blocks(gm, model, param_fqn, buffers)
    return TracedGraph(gm=gm, param_fqn=param_fqn, buffers=buffers, tied=tied, input_names=input_names,
                       output_name=output_name, source=source, trace_seconds=seconds,
                       fingerprint=fingerprint(gm, param_fqn, buffers), blocks=blocks, block_of=block_of,
                       constants=constants, frozen=frozen & set(param_fqn))


def _run_front_ends(model, root, example_inputs, frontend: str, prefix: str):
    """export, then the fx fallback (module doc); a TraceError when neither works. A TraceError of
    our own (e.g. forward returns two outputs) is the user's to fix, not the tracer's: it is raised
    as it is, once, instead of being retried by the fallback and wrapped."""
    export_error = None
    with _quiet_torch_logs():
        if frontend in ("auto", "export"):
            try:
                return _via_export(root, example_inputs)
            except TraceError:
                raise
            except Exception as e:  # any export failure: try the fallback, keep the error for the message
                export_error = e
                if frontend == "export":
                    raise _trace_error(model, root, [e], prefix) from e
        try:
            return _via_fx(root, example_inputs)
        except TraceError:
            raise
        except Exception as e:
            errors = [err for err in (export_error, e) if err is not None]
            raise _trace_error(model, root, errors, prefix) from e


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
                          f"the gradient of the traced ops instead of that backward, diverging from eager. autopar cannot keep a custom backward: write "
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
        outs = [o for o in (own if isinstance(own, tuple) else (own,)) if isinstance(o, torch.Tensor) and o.requires_grad]
        weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        g_own = torch.autograd.grad(outs, floats, weights, allow_unused=True)
        plain_args = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.requires_grad else a
                      for a in args]
        if "ctx" in inspect.signature(cls.forward).parameters or len(inspect.signature(cls.forward).parameters) > len(args):
            plain = cls.forward(_Ctx(), *plain_args, **kwargs)
        else:
            plain = cls.forward(*plain_args, **kwargs)
        pouts = [o for o in (plain if isinstance(plain, tuple) else (plain,)) if isinstance(o, torch.Tensor) and o.requires_grad]
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


def _frozen_params(root: nn.Module, param_fqn: dict[str, str], buffers: set[str]) -> set[str]:
    """Placeholders of parameters with requires_grad=False: stored like buffers, never trained
    (no gradient, no optimizer state, no gradient traffic; the planner prices them as buffers)."""
    params = dict(root.named_parameters(remove_duplicate=False))
    return {n for n, fqn in param_fqn.items()
            if n not in buffers and fqn in params and not params[fqn].requires_grad}


def _strip(fqn: str, prefix: str) -> str:
    return fqn[len(prefix):] if fqn.startswith(prefix) else ("" if fqn == prefix[:-1] else fqn)


def _strip_module_stacks(gm: GraphModule, prefix: str) -> None:
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:
            n.meta["nn_module_stack"] = {k: (_strip(fqn, prefix), cls) for k, (fqn, cls) in stack.items()}


# ---------------------------------------------------------------------------------------------
# Front ends


def _via_export(root: nn.Module, inputs: tuple):
    from torch.export.graph_signature import InputKind, OutputKind

    ep = torch.export.export(root, inputs, strict=False)
    sig = ep.graph_signature
    param_fqn, buffers, input_names, constants = {}, set(), [], {}
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            param_fqn[name] = spec.target
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            # Lifted constants (tensor attributes that are not registered buffers) behave as buffers;
            # their values are the exported program's, not a module attribute of that name.
            param_fqn[name] = spec.target
            buffers.add(name)
            if spec.kind == InputKind.CONSTANT_TENSOR:
                constants[spec.target] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            input_names.append(name)
        else:
            raise TraceError(f"unsupported exported input {name!r} of kind {spec.kind.name}")
    user_out = [s for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT]
    others = [s for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if others:
        # In-place buffer updates (BatchNorm running stats) are extra graph outputs we do not model.
        kinds = sorted({s.kind.name for s in others})
        raise TraceError(f"the model mutates state in forward ({', '.join(kinds)}: "
                         f"{[s.target for s in others]}); autopar traces pure training forwards: "
                         f"replace BatchNorm by LayerNorm/GroupNorm or remove the in-place update")
    if len(user_out) != 1 or not hasattr(user_out[0].arg, "name"):
        raise _outputs_error(root, len(user_out))
    return ep.graph_module, param_fqn, buffers, input_names, user_out[0].arg.name, "export", constants


def _via_fx(root: nn.Module, inputs: tuple):
    """symbolic_trace as a check, then an ATen graph via make_fx(pre_dispatch) on fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.fx.symbolic_trace(root)   # raises early, with a user frame, on data-dependent control flow
    params = dict(root.named_parameters())
    bufs = dict(root.named_buffers())

    pnames, bnames = list(params), list(bufs)

    def fn(*flat):
        # Flat positional arguments so the graph's placeholders are plain tensors, as in export.
        p = dict(zip(pnames, flat[:len(pnames)]))
        b = dict(zip(bnames, flat[len(pnames):len(pnames) + len(bnames)]))
        return torch.func.functional_call(root, (p, b), flat[len(pnames) + len(bnames):])

    gm = make_fx(fn, tracing_mode="fake", pre_dispatch=True)(*params.values(), *bufs.values(), *inputs)
    # Rename placeholders to export's convention (p_/b_ + FQN) so both front ends look alike.
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = ([("p_" + f.replace(".", "_"), f, False) for f in params]
             + [("b_" + f.replace(".", "_"), f, True) for f in bufs]
             + [(f"input_{i}", None, None) for i in range(len(inputs))])
    if len(names) != len(placeholders):
        raise TraceError(f"make_fx produced {len(placeholders)} placeholders for {len(names)} "
                         f"parameters, buffers and inputs; pass plain tensors as example inputs")
    param_fqn, buffers, input_names = {}, set(), []
    for node, (name, fqn, is_buffer) in zip(placeholders, names):
        node.name = node.target = name   # placeholder target is the forward's argument name
        if fqn is None:
            input_names.append(name)
        else:
            param_fqn[name] = fqn
            if is_buffer:
                buffers.add(name)
    gm.graph.lint()
    gm.recompile()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    if len(outs) != 1 or not isinstance(outs[0], Node):
        raise _outputs_error(root, len(outs))
    return gm, param_fqn, buffers, input_names, outs[0].name, "fx", {}


def _outputs_error(root: nn.Module, n: int) -> TraceError:
    what = type(root.model).__name__ if isinstance(root, _LossWrapper) else type(root).__name__
    where = "loss_fn" if isinstance(root, _LossWrapper) else f"{what}.forward"
    return TraceError(f"{where} returns {n} outputs (e.g. (logits, loss)); autopar trains on a forward that "
                      f"returns ONE scalar loss: return only the loss, or pass loss_fn=lambda out, *targets: ... "
                      f"that maps the model's output to the loss")


def _check_scalar_loss(gm: GraphModule, output_name: str, loss_fn) -> None:
    val = _node_by_name(gm, output_name).meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point:
        return
    what = (f"a tensor of shape {tuple(val.shape)} and dtype {val.dtype}" if isinstance(val, torch.Tensor)
            else type(val).__name__)
    fix = ("make loss_fn return a 0-d floating tensor (e.g. reduce with .mean())" if loss_fn is not None
           else "pass loss_fn=... so that loss_fn(model(*inputs), targets) is the scalar loss")
    raise TraceError(f"the traced forward must return a scalar floating-point loss, got {what}: {fix}")


# ---------------------------------------------------------------------------------------------
# Errors that point at the user's code


def _user_frames(exc: BaseException):
    """(FrameSummary, frame) pairs of user code in the traceback of exc and its causes, outermost
    first. User code: not torch, not this file, not a synthesized '<string>' frame."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            fname = os.path.abspath(frame.f_code.co_filename)
            if fname.startswith(_TORCH_DIR) or fname == _THIS_FILE or fname.startswith("<"):
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
# Tied weights


def _tied_fqns(model: nn.Module) -> dict[str, list[str]]:
    groups: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(fqn)
    for fqn, b in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(b), []).append(fqn)
    return {fqn: list(fqns) for fqns in groups.values() if len(fqns) > 1 for fqn in fqns}


def _drop_unused_tied_placeholders(gm, param_fqn, buffers, tied) -> None:
    """export lifts a tied tensor once per FQN but routes every use to one placeholder. Keep ONE
    placeholder per tensor: the used one, renamed to the canonical FQN (the first one
    ``named_parameters()`` reports, so ``dict(model.named_parameters())[param_fqn[name]]``
    works); drop the unused aliases."""
    if not tied:
        return
    by_fqn = {param_fqn[n.name]: n for n in gm.graph.nodes if n.op == "placeholder" and n.name in param_fqn}
    done = set()
    for fqns in tied.values():
        if fqns[0] in done:
            continue
        done.add(fqns[0])
        present = [by_fqn[f] for f in fqns if f in by_fqn]
        used = [n for n in present if n.users]
        if len(present) < 2 or len(used) > 1:
            continue   # nothing to merge (or the front end already kept them apart)
        keep = used[0] if used else present[0]
        canonical_name = next((n.name for n in present if param_fqn[n.name] == fqns[0]), keep.name)
        for n in present:
            if n is not keep:
                del param_fqn[n.name]
                buffers.discard(n.name)
                gm.graph.erase_node(n)
        is_buffer = keep.name in buffers
        del param_fqn[keep.name]
        buffers.discard(keep.name)
        # Placeholder names are free-form; the target is the forward's argument name.
        keep.name = keep.target = canonical_name
        param_fqn[canonical_name] = fqns[0]
        if is_buffer:
            buffers.add(canonical_name)
    gm.recompile()


# ---------------------------------------------------------------------------------------------
# Fingerprint


def _canon(x, index: dict[str, int]):
    """A canonical text of an argument: nodes by graph position, devices erased (a plan made on
    meta must match the same model on cpu/cuda)."""
    if isinstance(x, Node):
        return f"%{index[x.name]}"
    if isinstance(x, (list, tuple)):
        inner = ",".join(_canon(a, index) for a in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}:{_canon(v, index)}" for k, v in sorted(x.items())) + "}"
    if isinstance(x, torch.device):
        return "device"
    return repr(x)


def _val_text(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_val_text(a) for a in v) + ")"
    return type(v).__name__ if v is not None else "-"


def fingerprint(gm: GraphModule, param_fqn: dict[str, str], buffers: set[str]) -> str:
    """sha256 over ops, argument structure, shapes and dtypes (and parameter FQNs); independent
    of node names and devices."""
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            kind = "buffer" if n.name in buffers else ("param" if n.name in param_fqn else "input")
            line = f"placeholder {kind} {param_fqn.get(n.name, '')} {_val_text(n.meta.get('val'))}"
        else:
            line = (f"{n.op} {n.target} {_canon(n.args, index)} {_canon(n.kwargs, index)} "
                    f"{_val_text(n.meta.get('val'))}")
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Repeated blocks


def _block_children(model: nn.Module) -> dict[str, str]:
    """FQN of every child of an nn.ModuleList / nn.Sequential -> the container's FQN."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            for child, _ in mod.named_children():
                out[f"{name}.{child}" if name else child] = name
    return out


def _instance_key(node: Node, children: dict[str, str]):
    """(container, raw stack key, child FQN) of the outermost block ``node`` belongs to."""
    for key, (fqn, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        fqn = _strip_call_suffix(fqn)
        if fqn in children:
            return children[fqn], key, fqn
    return None


def _instance_signature(names: list[str], nodes: dict[str, Node], param_fqn, buffers) -> str:
    """Canonical text of one instance: in-instance references by position, outside references by
    kind, shape and dtype (the previous block's output differs per instance but must match)."""
    pos = {name: i for i, name in enumerate(names)}

    def ref(x):
        if isinstance(x, Node):
            if x.name in pos:
                return f"%{pos[x.name]}"
            # A user input and an activation play the same role (block 0 reads the input,
            # block i the previous block's output); parameters and buffers do not.
            kind = "buffer" if x.name in buffers else "param" if x.name in param_fqn else "act"
            return f"ext:{kind}:{_val_text(x.meta.get('val'))}"
        if isinstance(x, (list, tuple)):
            return "(" + ",".join(ref(a) for a in x) + ")"
        if isinstance(x, dict):
            return "{" + ",".join(f"{k}:{ref(v)}" for k, v in sorted(x.items())) + "}"
        if isinstance(x, torch.device):
            return "device"
        return repr(x)

    return "\n".join(f"{nodes[n].target} {ref(nodes[n].args)} {ref(nodes[n].kwargs)} "
                     f"{_val_text(nodes[n].meta.get('val'))}" for n in names)


def find_blocks(gm: GraphModule, model: nn.Module, param_fqn: dict[str, str], buffers: set[str]):
    """Group call_function nodes by the container child they belong to, then group instances with
    identical canonical signatures. Returns (groups, block_of)."""
    children = _block_children(model)
    nodes = {n.name: n for n in gm.graph.nodes}
    instances: dict[str, list[str]] = {}        # raw stack key -> node names, graph order
    meta: dict[str, tuple[str, str]] = {}       # raw stack key -> (container, child FQN)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        key = _instance_key(n, children)
        if key is None:
            continue
        container, raw, fqn = key
        instances.setdefault(raw, []).append(n.name)
        meta[raw] = (container, fqn)

    by_sig: dict[tuple[str, str], list[str]] = {}   # (container, signature) -> raw keys, graph order
    for raw, names in instances.items():
        sig = _instance_signature(names, nodes, param_fqn, buffers)
        by_sig.setdefault((meta[raw][0], sig), []).append(raw)

    groups: list[BlockGroup] = []
    per_container: dict[str, int] = {}
    for (container, _sig), raws in by_sig.items():
        if len(raws) < 2:
            continue
        k = per_container.get(container, 0)
        per_container[container] = k + 1
        name = (container or "<root>") + (f"#{k}" if k else "")
        groups.append(BlockGroup(name, [instances[r] for r in raws], [meta[r][1] for r in raws]))
    block_of = {name: (g, i, p) for g, grp in enumerate(groups)
                for i, inst in enumerate(grp.instances) for p, name in enumerate(inst)}
    return groups, block_of

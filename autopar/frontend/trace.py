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

``trace_step(module, example_inputs) -> TracedGraph``: an inference step returning several
tensors (logits and the updated KV cache), traced by export with its parameters frozen; every
output is kept (``TracedGraph.outputs``).

The TracedGraph also carries tied weights, a structural fingerprint and the repeated blocks
(``autopar/frontend/blocks.py``). The checks made while tracing and the error messages are in
``autopar/frontend/trace_checks.py``.
"""
from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from autopar.frontend.blocks import (BlockGroup, _drop_unused_tied_placeholders, _strip_call_suffix, _tied_fqns,
                            find_blocks, fingerprint)
from autopar.errors import TraceError
from autopar.frontend.fuse import fuse
from autopar.frontend.one_device import on_meta_when_mixed
from autopar.frontend.trace_checks import (_AutogradFunctionWatch, _backward_matches_forward, _check_arguments,
                                  _quiet_torch_logs, _strip, _trace_error)

__all__ = ["BlockGroup", "TracedGraph", "trace", "trace_step", "fingerprint", "find_blocks",
           "_backward_matches_forward"]


@dataclass
class TracedGraph:
    gm: GraphModule                      # placeholders: params/buffers, then user inputs; output: the loss
    param_fqn: dict[str, str]            # placeholder name -> FQN (parameters and buffers)
    buffers: set[str]                    # placeholder names that are not trained: buffers, lifted
                                         # constants, frozen parameters (requires_grad=False)
    tied: dict[str, list[str]]           # every FQN of a shared tensor -> all its FQNs (the one in param_fqn first)
    input_names: list[str]               # placeholder names of the user inputs, in order
    output_name: str                     # node whose value is the scalar loss (trace_step: its first output)
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
    kernels: bool = False                 # traced for the Triton kernels: patterns fused (autopar/frontend/fuse.py)
    fused: dict[str, int] = field(default_factory=dict)   # pattern -> how many were fused
    # Every user output's node name, in the forward's order: ``[output_name]`` for a training
    # trace, all of the step's outputs for ``trace_step``.
    outputs: list[str] = field(default_factory=list)
    # Traced by ``trace_step``: the outputs are values the step returns (autopar/rules/candidates.py
    # plans them as no partial sums, the reduction priced where it runs)
    step: bool = False
    # Memos of what depends on the graph alone (autopar/rules/candidates.py): every mesh's
    # candidates ask for them
    op_specs: dict = field(default_factory=dict, repr=False, compare=False)   # node name -> OpSpec
    needs_grad_memo: dict = field(default_factory=dict, repr=False, compare=False)   # (params, buffers) -> names
    chunk_numel: dict | None = field(default=None, repr=False, compare=False)   # parameter -> its ZeRO chunk's elements

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


def trace(model: nn.Module, example_inputs: tuple, loss_fn=None, *, frontend: str = "auto",
          kernels: bool = False) -> TracedGraph:
    """Trace ``model`` on ``example_inputs`` (real or meta tensors) into a TracedGraph.

    With ``loss_fn`` the traced function is ``loss_fn(model(*inputs[:k]), *inputs[k:])`` where k
    is the number of required positional parameters of ``model.forward``; without it,
    ``model(*inputs)`` must return the scalar loss. ``frontend``: "auto" (export, then fx),
    "export" or "fx" (mostly for tests). ``kernels``: fuse the patterns the runtime's kernels
    implement into their operators (autopar/frontend/fuse.py), as plans with Triton kernels run.
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
    with _AutogradFunctionWatch(root, prefix) as custom, on_meta_when_mixed(model, example_inputs) as inputs:
        result = _run_front_ends(model, root, inputs, frontend, prefix)
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
    _drop_metadata_asserts(gm)
    fused = fuse(gm) if kernels else {}
    output_name = gm.meta.pop("autopar_renamed", {}).get(output_name, output_name)   # a fused loss
    blocks, block_of = find_blocks(gm, model, param_fqn, buffers)
    return TracedGraph(gm=gm, param_fqn=param_fqn, buffers=buffers, tied=tied, input_names=input_names,
                       output_name=output_name, source=source, trace_seconds=seconds,
                       fingerprint=fingerprint(gm, param_fqn, buffers), blocks=blocks, block_of=block_of,
                       constants=constants, frozen=frozen & set(param_fqn), kernels=kernels,
                       fused=fused, outputs=[output_name])


def trace_step(module: nn.Module, example_inputs: tuple) -> TracedGraph:
    """Trace one forward step of ``module`` that returns SEVERAL tensors (an inference step: the
    logits and the updated KV cache) into a TracedGraph whose ``outputs`` lists every user
    output's node in order (``output_name`` is the first). Every parameter is traced frozen
    (``frozen``, stored as a buffer: no gradient, optimizer state or gradient traffic is priced);
    ``module`` itself is left untouched.

    Export only (``torch.export``, no fx fallback), with ``trace``'s checks: plain-tensor
    arguments, no state written in place (a cache update must be out of place, e.g.
    ``cache.index_copy(...)``, and returned), metadata asserts dropped, tied weights and repeated
    blocks found."""
    if not isinstance(module, nn.Module):
        raise TraceError(f"trace_step() needs an nn.Module, got {type(module).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    _check_arguments(module, example_inputs)
    t0 = time.perf_counter()
    with _AutogradFunctionWatch(module, "") as custom, on_meta_when_mixed(module, example_inputs) as inputs:
        with _quiet_torch_logs():
            try:
                gm, param_fqn, buffers, input_names, outputs, constants = _export_graph(module, inputs)
            except TraceError:
                raise
            except Exception as e:
                raise _trace_error(module, module, [e], "") from e
    if custom.calls:
        bad = custom.unverified()
        if bad:
            raise custom.error(module, bad)
    seconds = time.perf_counter() - t0
    if not outputs or any(o is None for o in outputs):
        raise TraceError(f"{type(module).__name__}.forward must return tensors (a tuple of them) for "
                         f"trace_step; got {len(outputs)} outputs, some not tensors computed by the graph")
    frozen = {n for n in param_fqn if n not in buffers}
    buffers |= frozen
    tied = _tied_fqns(module)
    _drop_unused_tied_placeholders(gm, param_fqn, buffers, tied)
    _drop_metadata_asserts(gm)
    blocks, block_of = find_blocks(gm, module, param_fqn, buffers)
    return TracedGraph(gm=gm, param_fqn=param_fqn, buffers=buffers, tied=tied, input_names=input_names,
                       output_name=outputs[0], source="export", trace_seconds=seconds,
                       fingerprint=fingerprint(gm, param_fqn, buffers), blocks=blocks, block_of=block_of,
                       constants=constants, frozen=frozen & set(param_fqn), outputs=list(outputs), step=True)


def _drop_metadata_asserts(gm: GraphModule) -> None:
    """Erases export's ``aten._assert_tensor_metadata`` checks (one after each ``.to(dtype)``):
    they read a tensor and produce nothing, so left in they would be planned as ops with no rule,
    run replicated, and price a gather of a split activation into a check."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()


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


def _frozen_params(root: nn.Module, param_fqn: dict[str, str], buffers: set[str]) -> set[str]:
    """Placeholders of parameters with requires_grad=False: stored like buffers, never trained
    (no gradient, no optimizer state, no gradient traffic; the planner prices them as buffers)."""
    params = dict(root.named_parameters(remove_duplicate=False))
    return {n for n, fqn in param_fqn.items()
            if n not in buffers and fqn in params and not params[fqn].requires_grad}


def _strip_module_stacks(gm: GraphModule, prefix: str) -> None:
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:
            n.meta["nn_module_stack"] = {k: (_strip(fqn, prefix), cls) for k, (fqn, cls) in stack.items()}


# ---------------------------------------------------------------------------------------------
# Front ends


@contextmanager
def _no_stack_traces():
    """torch.export without a Python stack trace captured per created node (``node.meta
    ["stack_trace"]``, which nothing in autopar reads): a third of a small model's export time
    (hf_llama: 0.15 of 0.5 s). The graph, its other metadata and the fingerprint are unchanged."""
    cfg = torch.fx.config
    old = getattr(cfg, "do_not_emit_stack_traces", None)
    if old is None:   # a torch without the switch: nothing to skip
        yield
        return
    cfg.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        cfg.do_not_emit_stack_traces = old


def _via_export(root: nn.Module, inputs: tuple):
    gm, param_fqn, buffers, input_names, outputs, constants = _export_graph(root, inputs, one_output=True)
    return gm, param_fqn, buffers, input_names, outputs[0], "export", constants


def _export_graph(root: nn.Module, inputs: tuple, one_output: bool = False):
    """torch.export of ``root`` with its state checks: (graph module, placeholder -> FQN, buffer
    placeholders, user input names, user output node names (None for an output that is no graph
    value), lifted constants). ``one_output``: anything but one graph value returned is an error."""
    from torch.export.graph_signature import InputKind, OutputKind

    with _no_stack_traces():
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
    if one_output and (len(user_out) != 1 or not hasattr(user_out[0].arg, "name")):
        raise _outputs_error(root, len(user_out))
    _check_no_state_writes(ep.graph_module, param_fqn, input_names)
    outputs = [getattr(s.arg, "name", None) for s in user_out]
    return ep.graph_module, param_fqn, buffers, input_names, outputs, constants


def _written_arguments(node: Node) -> list[Node]:
    """The graph values an in-place ATen op (``add_``, ``index_copy_``, ``copy_``...) writes: its
    arguments whose schema alias is written."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, Node):
                out.append(value)
    return out


def _view_base(node: Node) -> Node:
    """The value ``node`` is a view of: followed back through ops whose result aliases their first
    argument (slice, select, view, transpose, ...)."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if (schema is None or not schema.returns or schema.returns[0].alias_info is None
                or not node.args or not isinstance(node.args[0], Node)):
            break
        node = node.args[0]
    return node


def _check_no_state_writes(gm: GraphModule, param_fqn: dict[str, str], input_names: list[str]) -> None:
    """torch.export's training IR keeps in-place writes to buffers, parameters and inputs in the graph
    without listing them as mutations in its signature (BUFFER_MUTATION): a TraceError names them
    (autopar plans a pure forward: every rank would apply its own write to its own block)."""
    state = set(param_fqn) | set(input_names)
    writes = {}
    for node in gm.graph.nodes:
        for value in _written_arguments(node):
            base = _view_base(value)
            if base.op == "placeholder" and base.name in state:
                writes.setdefault(param_fqn.get(base.name, base.name), str(node.target))
    if writes:
        what = ", ".join(f"{name} ({op})" for name, op in sorted(writes.items()))
        raise TraceError(f"the model mutates state in forward: {what}; autopar traces pure training forwards: "
                         f"replace BatchNorm by LayerNorm/GroupNorm, or remove the in-place update of the "
                         f"buffer, parameter or input (write to a new tensor instead)")


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
    _check_no_state_writes(gm, param_fqn, input_names)
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


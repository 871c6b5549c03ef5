"""The fused linear + cross-entropy loss of a PyTorch model, computed by flce.

``RemoteLinearCrossEntropy`` is an ``nn.Module``: ``loss = module(hidden,
weight, target, bias)`` sends the tensors to the server's Forward, and
``loss.backward()`` calls Backward and hands dX, dW, db to autograd, so an
ordinary training loop (gradient accumulation included) works unchanged.
Tensors keep their dtype on the wire (bf16 stays bf16); results come back on
the input's device and in its dtype, the loss in float32.
"""

import copy
from typing import Optional

import torch

from flce.client import (Client, HostStaging, PendingForward, check_loss_options, to_torch,
                         wire_scalar)
from flce.row_pipeline import RowPipeline
from flce.weight_registration import WeightRegistration


def _graph_break(fn):
    """``fn`` run eagerly under torch.compile: a clean graph break around a
    call to the server (its own autograd Function, gRPC, host tensors), the
    graph compiled on either side. Unchanged where torch has no compiler."""
    compiler = getattr(torch, "compiler", None)
    disable = getattr(compiler, "disable", None)
    if disable is None:
        disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _set_loss_options(module, *, ignore_index, reduction, label_smoothing, logit_softcap,
                      z_loss_scale, class_weight, backward_mode):
    """Checks the loss options (ValueError naming the bad one) and sets them
    as the module's attributes."""
    check_loss_options(reduction=reduction, backward_mode=backward_mode,
                       label_smoothing=label_smoothing, logit_softcap=logit_softcap,
                       z_loss_scale=z_loss_scale)
    module.ignore_index = ignore_index
    module.reduction = reduction
    module.label_smoothing = label_smoothing
    module.logit_softcap = logit_softcap
    module.z_loss_scale = z_loss_scale
    module.class_weight = class_weight
    module.backward_mode = backward_mode


def _needs_grad(*tensors) -> bool:
    """Whether autograd will call backward through these inputs (grad mode
    on, one of them requires grad): only then the server keeps a session."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Session:
    """A server session owned by one autograd graph: released when the graph
    goes away without having consumed it (a loss dropped without backward(),
    or kept by ``retain_graph``). Its id may still be on its way (`pending`:
    the Forward in flight that makes it)."""

    def __init__(self, client, session_id="", pending=None):
        self.client = client
        self._id = session_id
        self.pending = pending
        self.consumed = False

    @property
    def id(self) -> str:
        if self.pending is not None:
            self._id = self.pending.result().session_id
            self.pending = None
        return self._id

    def __del__(self):
        if self.consumed:
            return
        try:
            if self.pending is not None and not self.pending.done():
                self.pending.release_when_done = True
            elif self.pending is None or self.pending.error() is None:
                if self.id:
                    self.client.release_session_later(self.id)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class _RemoteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, module, needs_grad):
        # (Grad mode is off inside forward: whether autograd will call
        # backward is decided by the caller, needs_grad.)
        # Through CUDA IPC the gradients come with the forward, for the
        # upstream gradient the last backward had (one round trip a step);
        # backward only checks that it was the right one.
        eager = None
        if needs_grad and module._eager_possible(hidden, weight, bias):
            eager = [None if x is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
                     for x in (hidden, weight, bias)]
        expected = module._expected_grad_output
        registration = module._registration
        ctx.registered = registration is not None
        if registration is not None:
            # The registered weight (sent only when it changed) stands in for
            # weight and bias; the server sums their gradients.
            weight_name, weight_version = registration.sync(weight, bias)
            wire_weight, wire_bias = None, None
        else:
            weight_name, weight_version = "", 0
            wire_weight, wire_bias = weight, bias
        ctx.step = None
        pieces = (module._pipeline.plan(hidden, module.reduction)
                  if module._pipeline is not None and registration is not None and needs_grad
                  and not module.retain_graph else 0)
        if pieces:
            # Over the network in row pieces: dX comes along (see
            # flce.row_pipeline), backward adds dW into the server's sum.
            with registration.behind():
                step = module._pipeline.forward(module, hidden, target, weight_name,
                                                weight_version, module._expected_grad_output,
                                                pieces)
            if step is not None:
                ctx.step, ctx.module, ctx.params = step, module, (weight, bias)
                module._last, module._backward_stats = step, None
                return torch.full((), float(step.loss), dtype=torch.float32,
                                  device=hidden.device)
        # With the gradients coming along, the loss too is written into this
        # process's GPU memory, and the call returns once the server has
        # accepted it: this stream waits on the GPU for the server's answer,
        # while autograd and the caller go on (backward reads the answer).
        # NaN stays there if the computation fails.
        loss = (torch.full((), float("nan"), dtype=torch.float32, device=hidden.device)
                if eager is not None else None)
        if registration is not None:
            registration.send_deferred()  # the row pieces' adds still to send
        result = module.client.forward(
            hidden, target, wire_weight, wire_bias, weight_name=weight_name,
            weight_version=weight_version,
            ignore_index=module.ignore_index, reduction=module.reduction,
            label_smoothing=module.label_smoothing, logit_softcap=module.logit_softcap,
            z_loss_scale=module.z_loss_scale, class_weight=module.class_weight,
            need_backward=needs_grad, backward_mode=module.backward_mode,
            shm=module._region_for(hidden, weight, bias, target), cuda_ipc=module.cuda_ipc,
            backward_into=eager, backward_grad_output=expected if eager else None,
            loss_out=loss, asynchronous=eager is not None,
            # Evaluation: X over the bulk connections where it is that large
            # (ignored with shared memory or CUDA IPC).
            bulk_hidden=not needs_grad)
        ctx.eager = (eager, expected) if eager is not None else None
        ctx.module = module
        ctx.meta = [(t.device, t.dtype, t.shape) if t is not None else None
                    for t in (hidden, weight, bias)]
        # The parameters, whose .grad a Backward may add into in place.
        ctx.params = (weight, bias)
        module._backward_stats = None
        if eager is not None:
            ctx.pending = result
            ctx.session = _Session(module.client, pending=result)
            # The session may be a RECOMPUTE one (its mode is in the answer).
            ctx.keep = (hidden, weight)
            module._last = result
            return loss
        ctx.pending = None
        ctx.session = _Session(module.client, result.session_id) if result.session_id else None
        # The session may read X and W again in Backward (RECOMPUTE, and
        # STORE_GRADS of one token chunk, which keeps logits): through CUDA
        # IPC they must stay alive (and unchanged) until then.
        ctx.keep = (hidden, weight) if module.cuda_ipc and result.session_id else None
        module._last = result
        if not result.loss.shape:
            # A scalar: made on the device by a fill (no copy to wait for).
            return torch.full((), wire_scalar(result.loss), dtype=torch.float32,
                              device=hidden.device)
        return to_torch(result.loss, hidden.device)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.step is not None:
            step, ctx.step = ctx.step, None
            module = ctx.module
            value = float(grad_output.detach().float().cpu().reshape(()))
            dx = step.finish(value, module._registration)
            module._expected_grad_output = value
            for _ in step.sessions:
                module._registration.added(*ctx.params)
            return dx, None, None, None, None, None
        session = ctx.session
        if session is None:
            return None, None, None, None, None, None
        if session.consumed:
            raise RuntimeError(
                "flce: backward already ran through this loss and its server session was "
                "consumed; to run backward more than once (retain_graph=True), construct "
                "RemoteLinearCrossEntropy(..., retain_graph=True)")
        module = ctx.module
        retain = module.retain_graph
        # With the gradients coming along, the upstream gradient sets off
        # for the host at once: on this stream its copy waits behind the
        # answer's fence, so it arrives with the answer instead of a round
        # trip to the GPU after it.
        upstream = (module._staging.start(grad_output.detach().float().reshape(()))
                    if ctx.eager is not None else None)
        if ctx.pending is not None:
            # The answer first (a failed computation raises here).
            ctx.pending.result()
            ctx.pending = None
        g = upstream.result() if upstream is not None else grad_output.detach().float().cpu()
        if ctx.eager is not None:
            into, expected = ctx.eager
            value = float(g.reshape(()))
            if value == expected:
                # The gradients are in place already; the session's job is
                # done (or kept for another backward with retain_graph).
                if not retain:
                    session.consumed = True
                    ctx.keep = None
                    # No reference of ours may stay: autograd then takes the
                    # tensors as .grad instead of copying them.
                    ctx.eager = None
                    # The next step's Forward releases it: no call of its own.
                    module.client.release_with_next_forward(session.id)
                return tuple(into) + (None, None, None)
            # Another upstream gradient: Backward redoes them exactly, and
            # the next forward expects this one.
            module._expected_grad_output = value
        # With CUDA IPC the server writes the GPU gradients in place: into
        # new tensors that autograd takes as they are, or (weight_grad_in_place)
        # added into the parameters' existing .grad, for which autograd then
        # gets None.
        into, in_place = None, False
        if module.cuda_ipc:
            into = [torch.empty(meta[2], device=meta[0], dtype=meta[1])
                    if meta is not None and meta[0].type == "cuda" else None
                    for meta in ctx.meta]
            grads_now = [p.grad if p is not None else None for p in ctx.params]
            if (module.weight_grad_in_place and into[1] is not None
                    and _can_add_into(grads_now[0], into[1])
                    and (into[2] is None or _can_add_into(grads_now[1], into[2]))):
                into[1], into[2] = grads_now[0], (grads_now[1] if into[2] is not None else None)
                in_place = True
        # Through shared memory the gradients land in a region of their own
        # that no live gradient views, and come back as views of it.
        region = module._grad_region(ctx.meta) if module.shared_memory else None
        grads = module.client.backward(session.id, g if g.dim() else g.reshape(()),
                                       keep_session=retain, shm=region,
                                       into=into, accumulate_into=in_place, copy_out=False,
                                       accumulate_weight_grad=ctx.registered)
        if ctx.registered:
            module._registration.added(*ctx.params)
        module._backward_stats = grads.stats
        # Without retain_graph the session is gone; with it, it lives until the
        # graph does.
        session.consumed = not retain
        if not retain:
            ctx.keep = None
        wire = (grads.grad_hidden, grads.grad_weight, grads.grad_bias)
        result = []
        for i, meta in enumerate(ctx.meta):
            if meta is None:
                result.append(None)
            elif (in_place or ctx.registered) and i > 0:
                result.append(None)  # added into .grad by the server, or summed there
            elif into is not None and into[i] is not None:
                result.append(into[i])
            elif region is not None and wire[i].HasField("shm"):
                device, dtype, _ = meta
                result.append(region.view_torch(wire[i]).to(device=device, dtype=dtype))
            else:
                device, dtype, _ = meta
                result.append(to_torch(wire[i]).to(device=device, dtype=dtype))
        return result[0], result[1], result[2], None, None, None


def _can_add_into(grad, like) -> bool:
    """Whether the server may add a gradient like ``like`` into ``grad`` (a
    parameter's .grad): a contiguous CUDA tensor of the same dtype and shape."""
    return (grad is not None and grad.is_cuda and grad.is_contiguous()
            and grad.dtype == like.dtype and grad.shape == like.shape
            and grad.device == like.device)


class RemoteLinearCrossEntropy(torch.nn.Module):
    """cross_entropy(hidden @ weight.T + bias, target) on an flce server.

    Options follow ``torch.nn.functional.cross_entropy`` (ignore_index,
    reduction, label_smoothing, weight → ``class_weight``) plus flce's
    ``logit_softcap`` and ``z_loss_scale``. ``backward_mode`` is "auto",
    "store_grads" or "recompute". ``shared_memory=True`` passes tensors
    through a POSIX shared-memory region (same host; the server runs with
    --enable_shared_memory); ``close()`` frees it. ``cuda_ipc=True`` lets
    the server read hidden and weight from, and write their gradients into,
    this process's GPU memory (same host, server on the CUDA backend with
    --enable_shared_memory): nothing but the targets travels, nothing is
    copied, each GPU allocation is registered once, and the server's work is
    ordered after this process's stream by an event (no device-wide
    synchronisation). With ``cuda_ipc``, ``weight_grad_in_place=True`` has
    the server add dW (and db) straight into ``weight.grad`` (``bias.grad``)
    when they exist, in their dtype and rounded as autograd adds, so gradient
    accumulation allocates no dW-sized temporary; autograd then sees no
    gradient for them (hooks on those parameters do not run).

    Over the network (neither shared_memory nor cuda_ipc) the weight and bias
    are registered with the server (PutWeight) on first use and again only
    when they changed (their version counter moved, e.g. in optimizer.step()),
    and Backward adds their gradients into the server's sum instead of
    sending them: each micro-batch moves X, the targets and dX only. Their
    ``.grad`` is filled by ``pull_weight_grads()`` — call it before gradient
    clipping or the optimizer step, or ``attach(optimizer)`` once to have it
    run before every step. ``register_weight=False`` sends W every call
    and returns dW to autograd instead. A batch whose X the client moves
    over its bulk connections (at least its ``bulk_threshold``, 1 MiB by
    default) goes through them in up to ``pipeline_pieces`` row pieces of
    at least ``pipeline_min_piece_bytes`` each (one piece when it has fewer
    bytes than two), each piece's transfer beside the server's work on the
    others, dX coming with the forward for the upstream gradient the last
    backward had (see :mod:`flce.row_pipeline`; ``pipeline_pieces=1``: one
    call with X and dX in its messages). Evaluation (no gradient) is one
    call, its X over the bulk connections where it is that large.

    Under ``torch.compile`` the module is a graph break: the model compiles
    around it, and the loss is the eager one.

    A server session is kept only when autograd will call backward (grad
    mode on and an input that requires grad); it is consumed by backward, or
    released when the loss is dropped without one. ``retain_graph=True``
    keeps it through backward, so that backward can run again (as with
    ``loss.backward(retain_graph=True)``), until the graph goes away;
    without it a second backward raises.
    """

    def __init__(self, client, *, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, logit_softcap: Optional[float] = None,
                 z_loss_scale: float = 0.0, class_weight=None, backward_mode: str = "auto",
                 shared_memory: bool = False, cuda_ipc: bool = False,
                 retain_graph: bool = False, weight_grad_in_place: bool = False,
                 register_weight: Optional[bool] = None, pipeline_pieces: int = 4,
                 pipeline_min_piece_bytes: int = 16 << 20):
        super().__init__()
        if shared_memory and cuda_ipc:
            raise ValueError("choose shared_memory or cuda_ipc, not both")
        if register_weight is None:
            register_weight = not (shared_memory or cuda_ipc)
        if register_weight and (shared_memory or cuda_ipc):
            raise ValueError("register_weight is for the network path: not with shared_memory "
                             "or cuda_ipc")
        _set_loss_options(self, ignore_index=ignore_index, reduction=reduction,
                          label_smoothing=label_smoothing, logit_softcap=logit_softcap,
                          z_loss_scale=z_loss_scale, class_weight=class_weight,
                          backward_mode=backward_mode)
        self.client = Client(client) if isinstance(client, str) else client
        # For copies (copy.deepcopy of a model that holds the module).
        self._options = dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            logit_softcap=logit_softcap, z_loss_scale=z_loss_scale, class_weight=class_weight,
            backward_mode=backward_mode, shared_memory=shared_memory, cuda_ipc=cuda_ipc,
            retain_graph=retain_graph, weight_grad_in_place=weight_grad_in_place,
            register_weight=register_weight, pipeline_pieces=pipeline_pieces,
            pipeline_min_piece_bytes=pipeline_min_piece_bytes)
        self.shared_memory = shared_memory
        self.cuda_ipc = cuda_ipc
        self.retain_graph = retain_graph
        self.weight_grad_in_place = weight_grad_in_place
        # Over the network the weight is registered and its gradients summed
        # on the server (pull_weight_grads / attach).
        self._registration = WeightRegistration(self.client) if register_weight else None
        # ... and a large batch goes in row pieces, the wire beside the GPU.
        self._pipeline = (RowPipeline(self.client, pipeline_pieces, pipeline_min_piece_bytes)
                          if register_weight and pipeline_pieces > 1 else None)
        self._region = None
        # Regions the gradients come back in, each reused once no gradient
        # viewing it is alive (autograd may keep one as .grad for a while).
        self._grad_regions = []
        # The last Forward's ForwardResult (or PendingForward), and the
        # CallStats of the last Backward (None when Forward brought the
        # gradients).
        self._last = None
        self._backward_stats = None
        # The upstream gradient the last backward had: through CUDA IPC the
        # next Forward computes the gradients for it.
        self._expected_grad_output = 1.0
        # Page-locked memory the upstream gradient comes to the host in.
        self._staging = HostStaging(max_kept=2)

    def __deepcopy__(self, memo):
        """A module with the same options on the same client (its connection
        is shared, not copied) and state of its own: its own registered
        weight, sessions and regions."""
        options = dict(self._options)
        options["class_weight"] = copy.deepcopy(options["class_weight"], memo)
        return RemoteLinearCrossEntropy(self.client, **options)

    def _last_result(self):
        last = self._last
        return last.result() if isinstance(last, PendingForward) else last

    @property
    def last_stats(self):
        """The server's CallStats of the last Forward and of its Backward
        (None when the Forward brought the gradients)."""
        last = self._last_result()
        return [last.stats if last is not None else None, self._backward_stats]

    @property
    def last_num_valid(self) -> int:
        """The last Forward's non-ignored rows."""
        last = self._last_result()
        return last.num_valid if last is not None else 0

    @property
    def last_z_loss(self) -> float:
        """The last Forward's z-loss term (summed for reduction none)."""
        last = self._last_result()
        if last is None:
            return 0.0
        return wire_scalar(last.z_loss) if not last.z_loss.shape else float(
            to_torch(last.z_loss).sum())

    def _region_for(self, hidden, weight, bias, target):
        """The shared-memory region for these tensors (grown as needed), or
        None when shared memory is off."""
        if not self.shared_memory:
            return None
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        # Inputs, or gradients in fp32 at most, each 64-byte aligned.
        need = max(nbytes(hidden) + nbytes(weight) + nbytes(bias) + target.numel() * 8,
                   4 * (hidden.numel() + weight.numel() + (0 if bias is None else bias.numel()))) + 256
        if self._region is None or self._region.nbytes < need:
            if self._region is not None:
                self._region.close()
            self._region = self.client.create_shared_memory(need)
        return self._region

    def _eager_possible(self, hidden, weight, bias) -> bool:
        """Whether Forward can bring the gradients (see _RemoteFunction)."""
        return (self.cuda_ipc and self.reduction != "none" and not self.weight_grad_in_place
                and all(t is None or t.is_cuda for t in (hidden, weight, bias)))

    def _grad_region(self, meta):
        """A gradient region with room for dX, dW, db (fp32 at most) that no
        live gradient views."""
        def nbytes(m):
            return 0 if m is None else 4 * int(torch.Size(m[2]).numel())
        need = sum(nbytes(m) + 64 for m in meta) + 256
        for region in self._grad_regions:
            if region.nbytes >= need and not region.in_use():
                return region
        idle = [r for r in self._grad_regions if not r.in_use()]
        for region in idle:  # too small: replaced
            region.close()
            self._grad_regions.remove(region)
        region = self.client.create_shared_memory(need)
        self._grad_regions.append(region)
        return region

    def pull_weight_grads(self):
        """Adds the dW (and db) the server summed since the last pull into
        ``weight.grad`` (``bias.grad``): call it before anything reads them
        (gradient clipping, the optimizer step). A no-op without a registered
        weight or with nothing waiting."""
        if self._registration is not None:
            self._registration.pull_grads()

    def attach(self, optimizer):
        """Pulls the weight's gradients before every ``optimizer.step()``."""
        if self._registration is not None:
            return self._registration.attach(optimizer)
        return None

    def close(self):
        if self._registration is not None:
            self._registration.close()
        for region in [self._region] + self._grad_regions:
            if region is not None:
                region.close()
        self._region = None
        self._grad_regions = []

    @_graph_break
    def forward(self, hidden, weight, target, bias=None):
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        flat_target = target.reshape(-1)
        loss = _RemoteFunction.apply(flat_hidden, weight, bias, flat_target, self,
                                     _needs_grad(hidden, weight, bias))
        if self.reduction == "none":
            return loss.reshape(target.shape)
        return loss

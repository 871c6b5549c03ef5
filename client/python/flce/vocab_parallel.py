"""Vocabulary parallelism for a torch.distributed job: the fused linear +
cross-entropy loss of an LM head whose weight is split by vocabulary over
the ranks of a process group (Megatron-style tensor parallelism).

Each rank holds the rows [first, first + V_s) of W (and of the bias) and the
whole batch (X, the targets). :class:`VocabParallelCrossEntropy` sends its
rank's shard to its flce server (a Forward with ``vocab_shard``), which
answers per-row statistics of the shard's logits — never the logits — and
combines them over the group with two all-reduces (a MAX of the rows'
maxima, then one SUM of the rescaled sums of exponentials, the target's
logit and, with label smoothing, the weighted logit sum): 12–16 bytes a row.
The loss follows, the same on every rank. Backward sends each row's global
log-sum-exp back to the rank's session, gets the shard's part of dX (fp32)
and its own rows of dW and db, and sums dX over the group with one more
all-reduce: autograd then holds dX on every rank and each rank's own dW and
db.

Every option of :class:`flce.RemoteLinearCrossEntropy` works (ignore_index,
every reduction, class weights — the whole vocabulary's, on every rank —,
label smoothing, the logit softcap, the z-loss, a bias); both backward
modes: "store_grads" (the server keeps the shard's logits: the reference's
high-performance mode) and "recompute" (memory-saving).
"""

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from flce.client import Client, from_wire, to_torch
from flce.torch_loss import _graph_break, _needs_grad, _Session, _set_loss_options


def _stat(tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(from_wire(tensor), dtype=np.float64))


class _VocabParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, module, needs_grad):
        m = module
        r = m.client.forward(hidden.detach(), target, weight.detach(),
                             None if bias is None else bias.detach(),
                             class_weight=m.class_weight, ignore_index=m.ignore_index,
                             reduction=m.reduction, label_smoothing=m.label_smoothing,
                             logit_softcap=m.logit_softcap, z_loss_scale=m.z_loss_scale,
                             need_backward=needs_grad, backward_mode=m.backward_mode,
                             vocab_shard=(m.first, m.full_vocab))
        ctx.session = _Session(m.client, r.session_id) if r.session_id else None
        s = r.shard_stats
        # The combine, in fp64: the rows' maxima first (one MAX), then the
        # rescaled sums, the target's logits and the weighted sums (one SUM).
        row_max = _stat(s.max)
        global_max = row_max.clone()
        dist.all_reduce(global_max, dist.ReduceOp.MAX, group=m.group)
        parts = [_stat(s.sum_exp) * torch.exp(row_max - global_max), _stat(s.target_logit)]
        if m.label_smoothing > 0:
            parts.append(_stat(s.weighted_logit_sum))
        summed = torch.stack(parts)
        dist.all_reduce(summed, dist.ReduceOp.SUM, group=m.group)
        lse = global_max + torch.log(summed[0])
        t = target.detach().reshape(-1).to("cpu", torch.int64)
        valid = t != m.ignore_index
        safe = torch.where(valid, t, torch.zeros_like(t))
        cw = None if m.class_weight is None else torch.as_tensor(
            m.class_weight).detach().to("cpu", torch.float64)
        w_t = cw[safe] if cw is not None else torch.ones_like(lse)
        eps = m.label_smoothing
        rows = (1 - eps) * w_t * (lse - summed[1]) + m.z_loss_scale * lse * lse
        if eps > 0:
            w_sum = float(cw.sum()) if cw is not None else float(m.full_vocab)
            rows = rows + eps / m.full_vocab * (w_sum * lse - summed[2])
        rows = torch.where(valid, rows, torch.zeros_like(rows))
        if m.reduction == "none":
            loss = rows
        elif m.reduction == "sum":
            loss = rows.sum()
        else:  # over zero valid rows 0/0 = NaN, as in PyTorch
            loss = rows.sum() / torch.where(valid, w_t, torch.zeros_like(w_t)).sum()
        ctx.module = m
        ctx.lse = lse.to(torch.float32)
        ctx.meta = [None if x is None else (x.device, x.dtype) for x in (hidden, weight, bias)]
        m._last = r
        return loss.to(device=hidden.device, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_loss):
        m, session = ctx.module, ctx.session
        if session is None or session.consumed:
            raise RuntimeError("flce: backward through a VocabParallelCrossEntropy loss twice "
                               "(or without a session: forward ran without grad)")
        g = grad_loss.detach().to("cpu", torch.float32)
        grads = m.client.backward(session.id, g if g.dim() else g.reshape(()),
                                  global_lse=ctx.lse.numpy(), float32_grads=True)
        session.consumed = True
        # This rank's part of dX: the group's parts sum to dX.
        dx = to_torch(grads.grad_hidden)
        dist.all_reduce(dx, dist.ReduceOp.SUM, group=m.group)
        out = []
        for tensor, meta in zip((dx, to_torch(grads.grad_weight),
                                 None if grads.grad_bias is None else to_torch(grads.grad_bias)),
                                ctx.meta):
            out.append(None if meta is None or tensor is None
                       else tensor.to(device=meta[0], dtype=meta[1]))
        return out[0], out[1], out[2], None, None, None


class VocabParallelCrossEntropy(torch.nn.Module):
    """cross_entropy(hidden @ W.T + b, target) where this rank holds the
    vocabulary ids [first, first + V_s) of W (and b) out of ``full_vocab``,
    and the ranks of ``group`` (the default one when None) hold the rest;
    computed by this rank's flce server (``client``: a :class:`flce.Client`
    or "host:port"). ``loss = module(hidden, weight_shard, target,
    bias_shard)``: the same loss on every rank; backward gives every rank dX
    and its own shard's dW and db. Options as
    :class:`flce.RemoteLinearCrossEntropy`'s; ``class_weight`` is the whole
    vocabulary's [full_vocab]."""

    def __init__(self, client, first: int, full_vocab: int, group=None, *,
                 ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, logit_softcap: Optional[float] = None,
                 z_loss_scale: float = 0.0, class_weight=None, backward_mode: str = "auto"):
        super().__init__()
        _set_loss_options(self, ignore_index=ignore_index, reduction=reduction,
                          label_smoothing=label_smoothing, logit_softcap=logit_softcap,
                          z_loss_scale=z_loss_scale, class_weight=class_weight,
                          backward_mode=backward_mode)
        if not 0 <= first < full_vocab:
            raise ValueError(f"first={first}: expected 0 <= first < full_vocab={full_vocab}")
        self.client = Client(client) if isinstance(client, str) else client
        self.first, self.full_vocab, self.group = first, full_vocab, group
        self._last = None  # the last Forward's ForwardResult

    @_graph_break
    def forward(self, hidden, weight, target, bias=None):
        if self.first + weight.shape[0] > self.full_vocab:
            raise ValueError(f"weight: {weight.shape[0]} rows from id {self.first} pass "
                             f"full_vocab={self.full_vocab}")
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        loss = _VocabParallelFunction.apply(flat_hidden, weight, bias, target.reshape(-1), self,
                                            _needs_grad(hidden, weight, bias))
        return loss.reshape(target.shape) if self.reduction == "none" else loss


def vocab_parallel_cross_entropy(hidden, weight_shard, target, client, first: int,
                                 full_vocab: int, group=None, bias_shard=None, **options):
    """The functional form of :class:`VocabParallelCrossEntropy` (a module
    made per call; keep one for repeated calls)."""
    return VocabParallelCrossEntropy(client, first, full_vocab, group, **options)(
        hidden, weight_shard, target, bias_shard)

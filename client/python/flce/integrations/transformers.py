"""A Hugging Face causal LM's training loss on flce, in one line.

    from flce.integrations.transformers import apply_flce
    apply_flce(model, "flce-host:50051")

After it, ``model(input_ids, labels=labels)`` — and ``transformers.Trainer``,
which calls it so — computes the loss on the flce server from the last
hidden states and ``lm_head``'s weight, without materialising the logits:
the labels shifted by one (the last position of each sequence predicts
nothing), ``-100`` ignored, and with ``num_items_in_batch`` (what the
Trainer passes for exact gradient accumulation) the sum over tokens divided
by it, else the mean over the non-ignored tokens: HF's own ``ForCausalLMLoss``.
Gemma 2's ``final_logit_softcapping`` becomes flce's logit softcap. Tied
embeddings need nothing: ``lm_head.weight`` is the embedding's parameter,
and its gradient reaches it through autograd. Logits are computed only
without labels (generation, inference) or when ``return_logits=True``.

Works on the causal LMs whose ``*ForCausalLM`` holds the decoder as
``.model`` and the head as ``.lm_head`` (Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Phi-3, and most others); tested on those six (bench/RESULTS.md).
The loss goes through a :class:`flce.RemoteLinearCrossEntropy` — give one
(configured as you like: ``cuda_ipc=True`` on the server's host) or a
target/:class:`flce.Client` and its options. By default dW goes to autograd
on every call (``register_weight=False``) so that the Trainer's gradient
clipping sees it; a registered weight whose gradients the server sums needs
``pull_weight_grads()`` before clipping, which the Trainer offers no hook for.
"""

import types
from typing import Optional

import torch

from flce.torch_loss import RemoteLinearCrossEntropy

IGNORE_INDEX = -100


def shifted_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The target of each position: the next position's label, and
    ``ignore_index`` for each sequence's last (HF's shift, padded instead
    of cut, so the hidden states need no copy)."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def causal_lm_loss(loss_fn: RemoteLinearCrossEntropy, hidden: torch.Tensor,
                   weight: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                   bias: Optional[torch.Tensor] = None, num_items_in_batch=None,
                   shift_labels: Optional[torch.Tensor] = None,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF's causal-LM loss of ``hidden`` [..., T, H] through ``weight`` (and
    ``bias``) against ``labels`` [..., T] (or ``shift_labels``, already
    shifted), computed by ``loss_fn`` (reduction "sum"): divided by
    ``num_items_in_batch`` when given, else by the count of non-ignored
    targets (the mean; NaN over none, as in PyTorch)."""
    if loss_fn.reduction != "sum":
        raise ValueError(f"loss_fn.reduction: {loss_fn.reduction!r}; causal_lm_loss needs 'sum'")
    target = shift_labels if shift_labels is not None else shifted_labels(labels, ignore_index)
    target = target.to(hidden.device)
    total = loss_fn(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias)
    if num_items_in_batch is None:
        num_items_in_batch = (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _logit_softcap(config) -> Optional[float]:
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def _flce_forward(self, input_ids=None, attention_mask=None, **kwargs):
    """The patched ``*ForCausalLM.forward`` (see the module's doc)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    flce = self.__dict__["_flce"]
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    logits_to_keep = kwargs.pop("logits_to_keep", kwargs.pop("num_logits_to_keep", 0))
    kwargs.pop("return_dict", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = outputs[0]
    loss = logits = None
    if labels is not None or shift_labels is not None:
        loss = causal_lm_loss(flce.loss_fn, hidden, self.lm_head.weight, labels,
                              bias=self.lm_head.bias, num_items_in_batch=num_items_in_batch,
                              shift_labels=shift_labels)
    if loss is None or flce.return_logits:
        keep = (slice(-logits_to_keep, None) if isinstance(logits_to_keep, int)
                else logits_to_keep)
        logits = self.lm_head(hidden[:, keep, :])
        cap = _logit_softcap(self.config)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
    return CausalLMOutputWithPast(loss=loss, logits=logits,
                                  past_key_values=getattr(outputs, "past_key_values", None),
                                  hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))


class _Patch:
    def __init__(self, loss_fn, return_logits, original):
        self.loss_fn = loss_fn
        self.return_logits = return_logits
        self.original = original


def apply_flce(model, target=None, *, loss_fn: Optional[RemoteLinearCrossEntropy] = None,
               return_logits: bool = False, **options) -> RemoteLinearCrossEntropy:
    """Makes ``model`` (a ``*ForCausalLM`` instance) compute its loss on
    flce; returns the :class:`flce.RemoteLinearCrossEntropy` it uses. Either
    ``loss_fn`` (whose reduction must be "sum"), or ``target`` (a "host:port"
    or a :class:`flce.Client`) and the module's ``options`` (reduction,
    ignore_index and logit_softcap are set here; register_weight defaults to
    False). ``return_logits``: compute the logits beside a loss too.
    :func:`remove_flce` undoes it."""
    if not hasattr(model, "lm_head") or not hasattr(model, "model"):
        raise ValueError(f"{type(model).__name__}: not a causal LM with .model and .lm_head")
    if "_flce" in model.__dict__:
        raise ValueError(f"{type(model).__name__}: flce is applied already")
    if loss_fn is None:
        if target is None:
            raise ValueError("give a target ('host:port' or a flce.Client) or loss_fn")
        for fixed in ("reduction", "ignore_index", "logit_softcap"):
            if fixed in options:
                raise ValueError(f"{fixed}: set by apply_flce (HF's loss), not an option")
        options.setdefault("register_weight", False)
        loss_fn = RemoteLinearCrossEntropy(target, reduction="sum", ignore_index=IGNORE_INDEX,
                                           logit_softcap=_logit_softcap(model.config), **options)
    elif loss_fn.reduction != "sum":
        raise ValueError(f"loss_fn.reduction: {loss_fn.reduction!r}; apply_flce needs 'sum'")
    # Not a submodule: state_dict and the model's parameters stay as they were.
    model.__dict__["_flce"] = _Patch(loss_fn, return_logits, model.__dict__.get("forward"))
    model.forward = types.MethodType(_flce_forward, model)
    return loss_fn


def remove_flce(model):
    """Gives ``model`` its own forward back."""
    patch = model.__dict__.pop("_flce", None)
    if patch is None:
        return
    if patch.original is None:
        del model.forward
    else:
        model.forward = patch.original

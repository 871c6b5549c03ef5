"""A PyTorch parameter registered with an flce server, sent only when it changed.

The LM head's weight is the biggest tensor of a loss call (V×H), and between
optimizer steps it does not change. A :class:`WeightRegistration` puts it on
the server once (PutWeight, with its bias) and again only when it changed —
PyTorch's version counter moves with every in-place update, such as the
optimizer's — so each micro-batch moves only X, the targets and dX. The
server sums dW (and db) of the Backward calls made with
``accumulate_weight_grad``; :meth:`pull_grads` takes the sum (TakeWeightGrad)
and adds it into the parameters' ``.grad`` — call it before anything reads
``.grad`` (gradient clipping, the optimizer step), or let :meth:`attach` do
it before each ``optimizer.step()``. The row pieces' adds into the sum
(``defer``) go out behind the next step's calls, or by themselves after
``SEND_AFTER_S``, and always before the sum is read.
"""

import contextlib
import threading
import time
import uuid
import warnings

import torch


class WeightRegistration:
    """One weight (and bias) registered with ``client`` under a name of its
    own (a fresh random one unless ``name`` is given)."""

    # Deferred adds (see defer()) go by themselves once they have waited
    # this long for a next step: a training loop's next loss call normally
    # comes sooner (it takes them), a model's backward and forward between
    # two loss calls often take longer (the adds then run on the server
    # while they do, not at the pull), and no add's session waits for the
    # server's TTL.
    SEND_AFTER_S = 0.05

    def __init__(self, client, name: str = ""):
        self._client = client
        self.name = name or f"flce-{uuid.uuid4().hex[:16]}"
        self._key = None        # what the registered version was made from
        self.version = 0        # the server's version, 0 before the first put
        self.puts = 0           # PutWeight calls so far
        self._pending = 0       # Backward calls whose dW waits on the server
        self._params = None     # (weight, bias) of the pending sum
        # Guards the adds' bookkeeping below, which the sender thread shares.
        self._lock = threading.Condition()
        self._in_flight = []    # (Backward calls adding into the sum, their settle)
        self._deferred = []     # (issue, settle) of adds not sent yet: see defer()
        self._deferred_at = 0.0  # when the oldest of them was deferred
        self._send_errors = []  # adds whose calls could not even be made
        self._sender = None     # the thread that sends deferred adds in time
        self._holding = 0       # steps under way (see behind())
        self._closed = False
        # For parameters on a GPU: page-locked host tensors the sum lands in,
        # kept from pull to pull, and the event of their last copy to the GPU.
        self._staging = None
        self._staged = None

    @staticmethod
    def _key_of(weight, bias):
        def key(t):
            return None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.dtype,
                                           t.device)
        return key(weight), key(bias)

    def adding(self, calls, settle):
        """Backward calls in flight that add into the sum: ``settle(calls)``
        waits for them (raising their error) before anything reads the sum
        or replaces the weight. Those already done and answered OK are
        settled now; a failed one stays for :meth:`settle` to raise."""
        with self._lock:
            self._in_flight.append((calls, settle))
            kept = []
            for entry in self._in_flight:
                if all(c.done() for c in entry[0]):
                    try:
                        entry[1](entry[0])
                        continue
                    except Exception:  # raised by settle(), later
                        pass
                kept.append(entry)
            self._in_flight = kept

    def defer(self, issue, settle):
        """Adds into the sum to send later: ``issue()`` makes the Backward
        calls (then as :meth:`adding`) at the next :meth:`send_deferred` —
        once the next step's calls are out —, before anything reads the sum
        or replaces the weight, or after ``SEND_AFTER_S`` without either."""
        with self._lock:
            if not self._deferred:
                self._deferred_at = time.monotonic()
            self._deferred.append((issue, settle))
            if self._sender is None and not self._closed:
                self._sender = threading.Thread(target=self._send_in_time, daemon=True,
                                                name="flce-weight-adds")
                self._sender.start()
            self._lock.notify()

    def send_deferred(self):
        """Sends the adds deferred so far (see :meth:`defer`)."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
            for issue, settle in deferred:
                try:
                    calls = issue()
                except Exception as e:  # e.g. the client closed: raised by settle()
                    self._send_errors.append(e)
                    continue
                self.adding(calls, settle)

    @contextlib.contextmanager
    def behind(self):
        """A step's calls going out: the deferred adds wait for them (the
        step calls :meth:`send_deferred` once they are out), not for
        ``SEND_AFTER_S``; a step that fails first sends them at its end."""
        with self._lock:
            self._holding += 1
        try:
            yield
        finally:
            with self._lock:
                self._holding -= 1
                self.send_deferred()

    def _send_in_time(self):
        with self._lock:
            while not self._closed:
                if not self._deferred:
                    # Idle for a second: the thread ends (the next defer()
                    # starts another), holding nothing alive meanwhile.
                    self._lock.wait(1.0)
                    if not self._deferred:
                        break
                    continue
                left = self._deferred_at + self.SEND_AFTER_S - time.monotonic()
                if left > 0 or self._holding:
                    self._lock.wait(left if left > 0 else self.SEND_AFTER_S)
                    continue
                self.send_deferred()
            self._sender = None

    def settle(self):
        """Sends the deferred adds and waits for the Backward calls still
        adding into the sum; the first error among them is raised (their dW
        is not in the sum)."""
        with self._lock:
            self.send_deferred()
            in_flight, self._in_flight = self._in_flight, []
            errors, self._send_errors = self._send_errors, []
        failed = errors[0] if errors else None
        for calls, settle in in_flight:
            try:
                settle(calls)
            except Exception as e:  # every call is waited for; the first error raised
                failed = failed or e
        if failed is not None:
            raise failed

    def sync(self, weight, bias=None):
        """Registers ``weight`` (and ``bias``) unless the registered version is
        theirs as they are now; returns (name, version) for Forward."""
        key = self._key_of(weight, bias)
        if key != self._key:
            self.settle()
            if self._pending:
                warnings.warn(
                    f"flce: the weight changed (e.g. optimizer.step()) while the dW of "
                    f"{self._pending} backward call(s) waited on the server unpulled; they are "
                    "dropped. Call pull_weight_grads() before the optimizer step, or "
                    "attach(optimizer).", RuntimeWarning, stacklevel=3)
                self._pending = 0
            info = self._client.put_weight(self.name, weight.detach(),
                                           None if bias is None else bias.detach())
            self.version = info.version
            self._key = key
            self.puts += 1
        return self.name, self.version

    def added(self, weight, bias=None):
        """A Backward added dW (and db) of this version into the server's sum."""
        self._pending += 1
        self._params = (weight, bias)

    @property
    def pending(self) -> int:
        """Backward calls whose dW waits on the server."""
        return self._pending

    def pull_grads(self):
        """Takes the server's sum of dW (and db) — rounded once to the weight's
        dtype — and adds it into ``weight.grad`` (``bias.grad``), or sets them
        where they are None. A no-op when nothing waits."""
        self.settle()
        if not self._pending:
            return
        weight, bias = self._params
        # Straight into CPU tensors of the parameters' dtype (the weight's
        # on the server), then onto their device.
        out = self._landing(weight, bias)
        dw, db, _ = self._client.take_weight_grad(self.name, self.version, float32=False,
                                                  out=out)
        self._pending = 0
        for param, grad in ((weight, dw), (bias, db)):
            if param is None or grad is None or not param.requires_grad:
                continue
            grad = grad.to(device=param.device, non_blocking=True)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        if weight.is_cuda:
            self._staged = torch.cuda.Event()
            self._staged.record(torch.cuda.current_stream(weight.device))

    def _landing(self, weight, bias):
        """CPU tensors of the parameters' shapes and dtypes for a take. For
        parameters on a GPU, the same page-locked ones every pull, once their
        last copy is done: the copy to the GPU runs at the bus's rate and no
        pages are faulted in (with new pageable ones, the pull of a 1 GiB
        bf16 weight's sum into a CUDA ``.grad`` took 0.45-0.51 s against
        0.23-0.27 s for the take alone into a reused tensor; bench/RESULTS.md).
        On the CPU, new ones (they become ``.grad``)."""
        params = (weight, bias)
        if not weight.is_cuda:
            return tuple(None if p is None else torch.empty(p.shape, dtype=p.dtype)
                         for p in params)
        if self._staged is not None:
            self._staged.synchronize()
        if self._staging is None or any(
                (p is None) != (s is None) or (p is not None and (s.shape != p.shape or
                                                                  s.dtype != p.dtype))
                for p, s in zip(params, self._staging)):
            self._staging = tuple(None if p is None else
                                  torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                                  for p in params)
        return self._staging

    def attach(self, optimizer):
        """Pulls the gradients before every ``optimizer.step()`` (a step
        pre-hook where PyTorch has them, else a wrapper of the instance's
        step). Gradient clipping before the step still needs an explicit
        :meth:`pull_grads` first."""
        if hasattr(optimizer, "register_step_pre_hook"):
            return optimizer.register_step_pre_hook(lambda *_: self.pull_grads())
        step = optimizer.step

        def stepping(*args, **kwargs):
            self.pull_grads()
            return step(*args, **kwargs)

        optimizer.step = stepping
        return None

    def close(self):
        """Deletes the registration from the server."""
        try:
            self.settle()
        except Exception:  # pragma: no cover - going away: nothing to add into
            pass
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._key is not None:
            try:
                self._client.delete_weight(self.name)
            except Exception:  # pragma: no cover - the server went away
                pass
            self._key = None
        self._staging = self._staged = None

"""Evaluation without a DataLoader: a model in eval mode called again and again inside one
``torch.no_grad()`` / ``torch.inference_mode()`` block on the stepping thread (nanoGPT's
``estimate_loss``, pytorch/examples word_language_model's ``evaluate()``: batches the script
cuts from a tensor itself, so no DataLoader call marks them as evaluation, see
:mod:`.evaluation`). The block's time, from entering it to leaving it, is an evaluation: taken
out of the wall time of the step it falls in and recorded as an ``evaluation`` event
(``detected_by``: ``forward-passes``).

Why these conditions and not any forward under no_grad: a single forward under no_grad is often
part of the training step itself (a frozen teacher in distillation, an EMA or BYOL target
network, both before the backward pass that trains), and taking it out would hide real step
time. An evaluation loop calls the same module at least twice in one block, in eval mode
(``model.eval()``, which nanoGPT, word_language_model, Lightning and the HF Trainer all call);
a target network in train mode, or a teacher called once, stays in the step.

Cost: ``no_grad.__enter__``/``__exit__`` and ``inference_mode``'s get a wrapper (a training step
enters no_grad a few times: ``clip_grad_norm_``, parameter updates by hand). While such a block
is open on the stepping thread, a global module forward pre-hook (torch's public
``register_module_forward_pre_hook``) sees the module calls; it is removed as soon as the
block is known not to be an evaluation (its first module is in train mode), else at the
block's end: in an evaluation it counts every forward pass of the model and its samples, at a
cost that falls within the evaluation's own time, which leaves the step. A DataLoader evaluation under way is left to
:mod:`.evaluation`, which already covers the block.
"""

from __future__ import annotations

from _thread import get_ident

from .contract import perf_ns
from .evaluation import Evaluation
from .steps import batch_len


class ForwardEvaluation:
    """The no_grad / inference_mode block open on the stepping thread, and what ran in it."""

    __slots__ = (
        "agent", "counter", "register", "depth", "thread", "start", "first", "calls",
        "samples", "handle", "is_evaluation",
    )  # fmt: skip

    def __init__(self, agent, counter, register) -> None:
        self.agent = agent
        self.counter = counter
        self.register = register  # torch.nn.modules.module.register_module_forward_pre_hook
        self.depth = 0  # nested blocks on self.thread: only the outermost one counts
        self.thread: int | None = None
        self.start = 0
        self.first = None  # the first module called in the block (the model)
        self.calls = 0
        self.samples: int | None = 0
        self.handle = None
        self.is_evaluation = False

    def enter(self) -> None:
        ident = get_ident()
        if self.depth:
            if ident == self.thread:
                self.depth += 1
            return
        counter = self.counter
        if counter.step_thread is not None and ident != counter.step_thread:
            return  # another thread's forward never takes time from the step (see steps.py)
        if counter.evaluation is not None:
            return  # a DataLoader evaluation under way: its own accounting covers the block
        self.depth = 1
        self.thread = ident
        self.start = perf_ns()
        self.first = None
        self.calls = 0
        self.samples = 0
        self.is_evaluation = False
        self.handle = self.register(self.on_forward)

    def on_forward(self, module, args) -> None:
        """The global forward pre-hook: runs before every module call while it is set."""
        if not self.agent.active or get_ident() != self.thread:
            if not self.agent.active:
                self._unhook()
            return
        first = self.first
        if first is None:
            if module.training:
                self._unhook()  # a network in train mode (an EMA target): part of training
                return
            self.first = module
            self._count(args)
            return
        if module is first:
            # Kept on to the block's end to count every pass and its samples: what it costs
            # (a call per module call) falls in the evaluation, whose time leaves the step.
            self._count(args)
            self.is_evaluation = True

    def _count(self, args) -> None:
        self.calls += 1
        n = batch_len(args, self.counter.tensor_type) if self.samples is not None else None
        self.samples = None if n is None else self.samples + n

    def exit(self) -> None:
        if get_ident() != self.thread:
            return
        self.depth -= 1
        if self.depth:
            return
        self._unhook()
        self.first = None
        self.thread = None
        counter = self.counter
        if not self.is_evaluation or not self.agent.active or counter.evaluation is not None:
            return  # not an evaluation, or a DataLoader one began inside (it covers the block)
        evaluation = Evaluation(self.start, "forward-passes")
        evaluation.batches = self.calls
        if self.samples is None:
            evaluation.samples_known = False
        else:
            evaluation.samples = self.samples
        counter.evaluation = evaluation
        counter.end_evaluation(perf_ns(), "block-end")

    def _unhook(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()


def install(agent, torch, counter, guard) -> None:
    """Wrap ``no_grad`` and ``inference_mode``'s ``__enter__``/``__exit__`` (undone by
    ``Agent.uninstall``). A torch without them, or without the global pre-hook, is left alone:
    its no-DataLoader evaluations stay inside the steps, as before."""
    from torch.autograd import grad_mode
    from torch.nn.modules import module as module_mod

    register = getattr(module_mod, "register_module_forward_pre_hook", None)
    if register is None:
        return
    tracker = ForwardEvaluation(agent, counter, register)
    on_enter = guard(agent, "no-grad-enter", tracker.enter)
    on_exit = guard(agent, "no-grad-exit", tracker.exit)
    inference_mode = getattr(grad_mode, "inference_mode", None)
    for cls, only_when_on in ((grad_mode.no_grad, False), (inference_mode, True)):
        if cls is None or "__enter__" not in cls.__dict__ or "__exit__" not in cls.__dict__:
            continue
        agent.patch(cls, "__enter__", _enter(agent, on_enter, cls.__enter__, only_when_on))
        agent.patch(cls, "__exit__", _exit(tracker, on_exit, cls.__exit__, only_when_on))


def _enter(agent, on_enter, original, only_when_on: bool):
    # only_when_on: inference_mode(False) leaves autograd as it was, so it opens no block.
    def __enter__(self):
        result = original(self)
        if agent.active and (not only_when_on or getattr(self, "mode", True)):
            on_enter()
        return result

    __enter__.__wrapped__ = original
    return __enter__


def _exit(tracker, on_exit, original, only_when_on: bool):
    def __exit__(self, exc_type, exc_value, traceback):
        # Before the original: the block's end is when its body ended. Checked without the
        # agent's flag, so that a block opened before the agent switched off drops its hook.
        if tracker.depth and (not only_when_on or getattr(self, "mode", True)):
            on_exit()
        return original(self, exc_type, exc_value, traceback)

    __exit__.__wrapped__ = original
    return __exit__

"""QAdam: Adam whose first moment is averaged through 8-bit compression
after a warm-up (Bagua's ``QAdamOptimizer`` and ``QAdamAlgorithm``).

During the first ``warmup_steps`` steps gradients are averaged exactly and
:class:`QAdamOptimizer` is Adam (the same arithmetic as
``torch.optim.Adam``, bit for bit). From then on the second moment is
frozen; before each step every rank updates its first moment with its own
gradient (``m = beta1 m + (1 - beta1) g``) and the moments, not the
gradients, are averaged through MinMaxUInt8 compression (``hierarchical``:
exact within hosts, compressed between them; ``error_feedback``, ringlet's
addition: residuals carried to the next step).

Example:
  >>> opt = QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
  >>> model = model.with_bagua([opt], QAdamAlgorithm(opt))
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import Optimizer

from ..bucket import BaguaBucket
from ..communication import BaguaProcessGroup
from .base import Algorithm, AlgorithmImpl, aligned_buckets, ensure_tensor

__all__ = ["QAdamAlgorithm", "QAdamAlgorithmImpl", "QAdamOptimizer"]

_log = logging.getLogger(__name__)


class QAdamOptimizer(Optimizer):
    """The optimizer of the QAdam algorithm.

    Args:
      params (iterable): Parameters or parameter groups.
      lr (float): Learning rate. Default: 1e-3.
      warmup_steps (int): Steps of plain Adam on exactly averaged gradients
        before the moments are compressed (must be positive). Default: 100.
      betas (tuple[float, float]): Running average coefficients. Default:
        (0.9, 0.999).
      eps (float): Added to the denominator. Default: 1e-8.
      weight_decay (float): L2 penalty. Default: 0.

    Raises:
      ValueError: A negative ``lr`` or ``eps``, betas outside ``[0, 1)``, or
        ``warmup_steps`` below 1 (Bagua's messages).

    Example:
      >>> opt = QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=20)
    """

    def __init__(self, params: Any, lr: float = 1e-3, warmup_steps: int = 100,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if warmup_steps <= 0:
            raise ValueError(
                f"Invalid warmup_steps parameter, must be larger than 0: {warmup_steps}"
            )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """One optimizer step.

        Args:
          closure (Callable, optional): Re-evaluates the model, returns the loss.

        Returns:
          The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                state["step"] += 1
                step = state["step"]
                grad = param.grad
                if wd != 0:
                    grad = grad.add(param, alpha=wd)
                if step < self.warmup_steps:
                    # torch.optim.Adam's own arithmetic (single-tensor path).
                    state["exp_avg"].lerp_(grad, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** float(step)
                bias_correction2 = 1 - beta2 ** float(step)
                denom = (state["exp_avg_sq"].sqrt() / (bias_correction2 ** 0.5)).add_(eps)
                param.addcdiv_(state["exp_avg"], denom, value=-(lr / bias_correction1))
        return loss


class QAdamAlgorithmImpl(AlgorithmImpl):
    """The implementation of :class:`QAdamAlgorithm`.

    Args:
      process_group (BaguaProcessGroup): The group to work on.
      q_adam_optimizer (QAdamOptimizer): The model's optimizer.
      hierarchical (bool): Exact within hosts, compressed between them.
        Default: True.
      error_feedback (bool): Carry quantization residuals. Default: False.
    """

    def __init__(self, process_group: BaguaProcessGroup, q_adam_optimizer: QAdamOptimizer,
                 hierarchical: bool = True, error_feedback: bool = False) -> None:
        super().__init__(process_group)
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(f"QAdamAlgorithm needs a QAdamOptimizer, got "
                            f"{type(q_adam_optimizer).__name__}")
        self.hierarchical = hierarchical
        self.error_feedback = error_feedback
        self.optimizer = q_adam_optimizer
        self.warmup_steps = q_adam_optimizer.warmup_steps

    @property
    def optimizer_step_id(self) -> int:
        """Optimizer steps taken so far."""
        param = self.optimizer.param_groups[0]["params"][0]
        return int(self.optimizer.state[param].get("step", 0))

    def need_reset(self) -> bool:
        if self.optimizer_step_id == self.warmup_steps:
            _log.info("QAdam starts to compress from step %d", self.optimizer_step_id)
            return True
        return False

    def _compressing(self) -> bool:
        return self.optimizer_step_id >= self.warmup_steps

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        parameters = bagua_ddp.bagua_build_params()
        for idx, (name, param) in enumerate(reversed(parameters)):
            param._q_adam_name = name
            param._q_adam_idx = idx
        opt = self.optimizer

        def momentum(p: torch.Tensor) -> torch.Tensor:
            return opt.state[p]["exp_avg"]  # type: ignore[no-any-return]

        def set_momentum(p: torch.Tensor, t: torch.Tensor) -> None:
            opt.state[p]["exp_avg"] = t

        def grad(p: torch.Tensor) -> Optional[torch.Tensor]:
            return p.grad

        def set_grad(p: torch.Tensor, t: torch.Tensor) -> None:
            p.grad = t

        compressing = self._compressing()
        tensors = []
        for group in opt.param_groups:
            for param in group["params"]:
                if not hasattr(param, "_q_adam_name"):
                    continue
                param.ringlet_ensure_grad()
                getter, setter = (momentum, set_momentum) if compressing else (grad, set_grad)
                tensors.append(ensure_tensor(param, param._q_adam_name,
                                             bagua_ddp.bagua_module_name, getter, setter))
        tensors.sort(key=lambda p: p._q_adam_idx)
        self._communication_tensor_names = {t._ringlet_name for t in tensors}
        return tensors

    def tensors_to_buckets(self, tensors: list[list[Any]], do_flatten: bool) -> list[BaguaBucket]:
        return aligned_buckets(tensors, do_flatten, len(self.process_group.ranks))

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        if not self._compressing():
            bucket.append_centralized_synchronous_op(
                hierarchical=False, average=True, group=self.process_group
            )
            return
        opt = self.optimizer

        def calculate_momentum(*_args: Any) -> None:
            beta1, _ = opt.param_groups[0]["betas"]
            with torch.no_grad():
                for t in bucket.tensors:
                    t.ringlet_getter_closure().mul_(beta1).add_(t.grad, alpha=1 - beta1)

        bucket.append_python_op(calculate_momentum, group=self.process_group)
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=True, scattergather=True,
            compression="MinMaxUInt8", group=self.process_group,
            error_feedback=self.error_feedback,
        )

    def init_backward_hook(self, bagua_ddp: Any) -> Callable[[str, torch.Tensor], None]:
        names = self._communication_tensor_names

        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            if getattr(parameter, "_ringlet_name", None) in names:
                parameter.ringlet_mark_communication_ready()

        return hook


class QAdamAlgorithm(Algorithm):
    """QAdam: Adam with its first moment averaged in 8 bits after a warm-up.

    Args:
      q_adam_optimizer (QAdamOptimizer): The model's optimizer.
      hierarchical (bool): Exact within each host, compressed between hosts.
        Default: True.
      error_feedback (bool): Add each quantization's residual to the next
        step's momentum (ringlet's addition). Default: False.

    Example:
      >>> opt = QAdamOptimizer(model.parameters(), warmup_steps=50)
      >>> model.with_bagua([opt], QAdamAlgorithm(opt, hierarchical=False))
    """

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True,
                 error_feedback: bool = False) -> None:
        self.hierarchical = hierarchical
        self.error_feedback = error_feedback
        self.optimizer = q_adam_optimizer

    def reify(self, process_group: BaguaProcessGroup) -> QAdamAlgorithmImpl:
        return QAdamAlgorithmImpl(process_group, q_adam_optimizer=self.optimizer,
                                  hierarchical=self.hierarchical,
                                  error_feedback=self.error_feedback)



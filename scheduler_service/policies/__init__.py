"""Scheduling policies behind the AdmissionPolicy seam (admission.py), chosen by
`option.scheduling_policy`: fcfs (admission.FCFSAdmission), priority (priority.py), mlfq
(mlfq.py). Each is pure planning logic, tested without gRPC."""

from __future__ import annotations

from scheduler_service.admission import AdmissionPolicy, FCFSAdmission
from scheduler_service.policies.mlfq import MLFQAdmission, MLFQConfig
from scheduler_service.policies.priority import PriorityAdmission
from seqserve_common.config import SCHEDULING_POLICIES, ServingConfig

assert SCHEDULING_POLICIES == ("fcfs", "priority", "mlfq"), "keep make_policy in step"


def make_policy(cfg: ServingConfig) -> AdmissionPolicy:
    """A fresh policy for one worker's loop (ValueError on a bad setting)."""
    name = cfg.scheduling_policy
    if name == "fcfs":
        return FCFSAdmission()
    if name == "priority":
        return PriorityAdmission(cfg.priority_aging_steps)
    if name == "mlfq":
        return MLFQAdmission(MLFQConfig(
            levels=cfg.mlfq_levels, base_quantum=cfg.mlfq_quantum_steps,
            prefill_tokens_per_step=cfg.mlfq_prefill_tokens_per_step,
            aging_steps=cfg.priority_aging_steps))
    raise ValueError(f"option.scheduling_policy {name!r} is unknown; choose one of "
                     f"{', '.join(SCHEDULING_POLICIES)}")

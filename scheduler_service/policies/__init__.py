"""Scheduling policies behind the AdmissionPolicy seam (admission.py), chosen by
`option.scheduling_policy`: fcfs (admission.FCFSAdmission), priority (priority.py), mlfq
(mlfq.py), length-aware (length_aware.py, length_predictor.py), length-batched
(length_batched.py). Each is pure planning logic, tested without gRPC."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_service.admission import AdmissionPolicy, FCFSAdmission
from scheduler_service.policies.length_aware import LengthAwareAdmission, grow_margin
from scheduler_service.policies.length_batched import LengthBatchedAdmission
from scheduler_service.policies.length_predictor import LengthPredictor, PredictorConfig
from scheduler_service.policies.mlfq import MLFQAdmission, MLFQConfig
from scheduler_service.policies.priority import PriorityAdmission
from seqserve_common.config import LENGTH_PREDICTORS, SCHEDULING_POLICIES, ServingConfig

assert SCHEDULING_POLICIES == ("fcfs", "priority", "mlfq", "length-aware", "length-batched"), \
    "keep make_policy in step"


def policy_factory(cfg: ServingConfig) -> Callable[[], AdmissionPolicy]:
    """Makes one policy per worker's loop; they share one length predictor, which
    learns from the requests of every worker."""
    predictor = LengthPredictor(PredictorConfig(bucket_tokens=cfg.length_bucket_tokens))
    make_policy(cfg, predictor)  # a bad setting fails now, at start-up
    return lambda: make_policy(cfg, predictor)


def make_policy(cfg: ServingConfig, predictor: LengthPredictor | None = None
                ) -> AdmissionPolicy:
    """A fresh policy for one worker's loop (ValueError on a bad setting)."""
    name = cfg.scheduling_policy
    if name == "fcfs":
        return FCFSAdmission()
    if name == "priority":
        return PriorityAdmission(cfg.priority_aging_steps,
                                 cfg.priority_background_chunk_tokens,
                                 urgent_steps=cfg.priority_urgent_steps)
    if name == "mlfq":
        return MLFQAdmission(MLFQConfig(
            levels=cfg.mlfq_levels, base_quantum=cfg.mlfq_quantum_steps,
            prefill_tokens_per_step=cfg.mlfq_prefill_tokens_per_step,
            aging_steps=cfg.priority_aging_steps))
    if name in ("length-aware", "length-batched"):
        predictor = predictor or LengthPredictor(
            PredictorConfig(bucket_tokens=cfg.length_bucket_tokens))
        # The reservations' margin covers the tokens of the loop's Steps in flight.
        margin = grow_margin(cfg.steps_in_flight)
        if name == "length-batched":
            return LengthBatchedAdmission(predictor, margin)
        use = cfg.length_predictor
        if use not in LENGTH_PREDICTORS:
            raise ValueError(f"option.length_predictor {use!r} is unknown; choose one of "
                             f"{', '.join(LENGTH_PREDICTORS)}")
        return LengthAwareAdmission(predictor, cfg.priority_aging_steps,
                                    use_prompt=use != "hidden", use_hidden=use != "prompt",
                                    margin=margin)
    raise ValueError(f"option.scheduling_policy {name!r} is unknown; choose one of "
                     f"{', '.join(SCHEDULING_POLICIES)}")

"""Bounds for the invariant tests that compare two trainings.

**Trainers in float64** (dp sizes, micro-batch splits, dropped groups, LoRA at dp = 2). The invariants are checked in float64 (``PolicyTrainer(dtype=)``), with bounds derived from what
may legitimately differ. The compared paths add the same per-token gradient terms in other orders
and groupings (each rank its rows, then a SUM over ranks; other micro-batch boundaries, so other
GEMM blockings), so they agree up to rounding, and AdamW amplifies rounding: its step
lr·m̂/(√v̂ + ε) has slope up to lr/ε in a coordinate whose gradient is near 0, so a gradient
difference δ there moves the weight by up to lr·δ/ε (10^6·δ at lr = 1e-2). In float32, δ ≈ 1e-11
made dp = 2 and dp = 1 differ by 1.5e-5 on one CI machine (issue 24), and one dp = 1 run cut into
other micro-batches differs from itself as much (3.7e-6 on another). In float64 a sum of N ≲ 10^3
terms whose magnitudes add up to ≲ 1 (the loss is a token mean, activations are normalised)
changes between orders by δ ≤ 2N·2^-53 ≈ 2e-13, so the weights may differ by Σlr·δ/ε over the
updates: ``param_atol(Σlr)``; PARAM_ATOL covers test_trainer_fsdp's runs (at most 10 updates at
lr = 3e-3: 6e-7; measured ~1e-14). A real dp bug (a row trained twice or not at all, a rank-local
normaliser, an update skipped on one rank) moves some weight by an lr-sized step, ≥ 3e-3. Metrics are smooth in the weights and sums of at most a few
thousand float64 terms: they differ by ≲ PARAM_ATOL too (METRIC_TOL). Gradients compared without
an optimiser step differ by δ alone (GRAD_ATOL).

**Pipelines in float32 with SGD** (asynchronous at η = 0 ≡ synchronous, colocated ≡ disaggregated).
What may legitimately differ, and the bounds: with two requests in flight the engine batches rows
as they arrive, so a sample's behaviour log-probs may differ in their float32 rounding (≲ 1e-6).
They enter the loss through the importance ratio only, so every gradient term changes by ≲ 1e-6
relative, and the backward's own rounding, over N ≲ 10^3 terms whose magnitudes add up to ≲ 1
(the gradient is clipped to norm 1), by δ ≤ 2N·2^-24 ≈ 1.2e-4. With plain SGD (trainer.optimizer=
sgd) an update is lr·g, so after T updates the weights differ by ≤ T·lr·δ: ``sgd_weight_atol``. AdamW's
division by √v would turn δ in a coordinate whose gradient is near 0 into an lr-sized step (no
bound below lr at all). A push missed or applied twice moves the weights by lr·g, up to ~1e-2
here (and shows in the next step's ratio at once). Metrics are computed from the same samples:
rounding, plus weights that differ by ≤ WEIGHT_ATOL (PIPELINE_METRIC_TOL).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE", "ADAM_EPS", "param_atol", "PARAM_ATOL", "METRIC_TOL", "GRAD_ATOL", "sgd_weight_atol",
           "PIPELINE_METRIC_TOL", "ON_POLICY_RATIO_ATOL", "ON_POLICY_KL_MAX"]

DTYPE = torch.float64
ADAM_EPS = 1e-8  # torch's AdamW default, which PolicyTrainer keeps


def param_atol(lr_sum: float) -> float:
    """The bound on weight differences after updates whose learning rates add up to ``lr_sum``."""
    return lr_sum * 2 * 1e3 * 2.0**-53 / ADAM_EPS


PARAM_ATOL = 1e-6  # >= param_atol(0.03): test_trainer_fsdp's 5 steps x 2 mini-batches at lr = 3e-3
METRIC_TOL = {"rel_tol": 1e-6, "abs_tol": 1e-9}
GRAD_ATOL = 1e-11  # 50x the worst-case delta of a sum of 1e3 float64 terms


def sgd_weight_atol(*, steps: int, lr: float) -> float:
    """The bound on float32 weight differences after ``steps`` SGD updates at ``lr``."""
    return steps * lr * 2 * 1e3 * 2.0**-24


PIPELINE_METRIC_TOL = {"rel": 1e-4, "abs": 1e-6}  # pytest.approx's keywords

# On-policy (max_staleness = 0) the engine's behaviour log-probs and the trainer's are one policy's,
# computed by two float32 programs (incremental decode with a KV cache vs one full forward, other
# batch rows): they differ by rounding, |Δlogp| ≲ 1e-6, so a ratio exp(Δ) is within ~2e-6 of 1
# (seen: 4 ulps, 4.8e-7, with TorchEngine and with the SGLang backend alike) and the mismatch KL,
# ~Δ²/2, below 1e-12. A push missed by one version moves them by ~1e-2.
ON_POLICY_RATIO_ATOL = 2e-6
ON_POLICY_KL_MAX = 1e-10

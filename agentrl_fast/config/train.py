"""Everything a training run needs besides the models and the environment (a leaf: standard
library and the rollout and distributed configs only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl_fast.config.distributed import DistributedConfig
from agentrl_fast.config.rollout import RolloutConfig

ALGORITHMS = ("ppo", "grpo")
CRITICS = ("separate", "shared")
LR_SCHEDULES = ("constant", "linear", "cosine")
KL_MODES = ("loss", "reward")


@dataclass
class TrainConfig:
    """Everything a run needs besides the models and the environment (see the README)."""

    algo: str = "ppo"
    seed: int = 0
    steps: int = 10
    tasks_per_step: int = 8
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    micro_batch_tokens: int = 4096
    mini_batches: int = 1
    epochs: int = 1
    policy_lr: float = 1e-4
    critic_lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    max_grad_norm: float = 1.0
    gamma: float = 1.0
    lam: float = 0.95
    # The critic's GAE lambda for its value targets (None: lam). Decoupled GAE (VC-PPO, VAPO):
    # lam = 1 gives the policy unbiased returns over long traces while the critic still learns
    # from lower-variance targets.
    critic_lam: float | None = None
    # GAE's lambda-return continues through a compaction (each rollout's sub-traces as one
    # sequence; with lam = 1 every token's return is its rollout's return). True restarts it at
    # each compaction, leaving everything after one to the critic's value there: on the vault
    # task's 6-sub-trace episodes the outcome then reaches the early sub-traces only as fast
    # as the critic learns it (docs/experiments.md).
    gae_restart_at_compaction: bool = False
    bootstrap_truncated: bool = True  # False: a limit ends the episode (see train.advantages)
    whiten_advantages: bool = True
    # The advantage estimator, a name in agentrl_fast.train.advantages.ADVANTAGE_ESTIMATORS
    # ("gae", "grpo", or one registered with register_advantage) or "package.module:function";
    # None: "gae" for ppo, "grpo" for grpo.
    advantage_estimator: str | None = None
    # The policy loss, a name in agentrl_fast.train.losses.POLICY_LOSSES ("ppo", or one
    # registered with register_policy_loss) or "package.module:function".
    policy_loss: str = "ppo"
    loss_agg_mode: str | None = None  # default: token-mean (ppo), rollout-mean (grpo)
    loss_norm_constant: float | None = None  # seq-mean-token-sum-norm's constant
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_mode: str = "loss"
    kl_estimator: str = "k3"
    kl_target: float | None = None
    kl_horizon: int = 100
    tis_cap: float | None = None
    critic: str = "separate"
    value_coef: float = 0.5
    critic_warmup_steps: int = 0
    # The separate critic's epochs over the batch, on the same mini-batches (verl's critic
    # ppo_epochs); None: ``epochs``.
    critic_epochs: int | None = None
    # On the CPU (one process, 2+ threads): the separate critic's update of a mini-batch runs in
    # a thread beside the policy's, each on half the intra-op threads.
    overlap_critic: bool = True
    # False: the old log-probs PPO's ratio starts from are the rollout's own sampling log-probs
    # (the same policy and temperature, so equal up to float rounding: the mismatch metric
    # shows it when recomputing) instead of one more forward of the policy over the batch
    # (verl's bypass mode). Needs a generator that records the policy's log-probs, as
    # TorchGenerator does. None: recomputed exactly when training is asynchronous.
    recompute_logprobs: bool | None = True
    # Asynchronous training (docs/training.md): rollouts are produced beside the learner, and a
    # rollout is trained on only while its oldest token is at most max_staleness versions
    # (learner steps) behind. 0: synchronous (roll out, then learn). Needs the recomputed
    # (proximal) log-probs and tis_cap (the behaviour importance weight's cap).
    max_staleness: int = 0
    # Asynchronous: a rollout whose weights change mid-episode keeps its turns with the versions
    # that sampled them (partial rollouts); False restarts its whole group from the first turn
    # on the new weights (abort-and-restart: every rollout on one version, at the cost of the
    # discarded turns; a group slower than a learner step may restart more than once).
    partial_rollouts: bool = True
    grpo_normalize_std: bool = True
    # Dynamic sampling (DAPO): train only on task groups whose rollouts' rewards differ, rolling
    # out up to max_rollout_rounds batches of tasks_per_step tasks to find tasks_per_step of them.
    filter_groups: bool = False
    max_rollout_rounds: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int | None = 3
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # under torchrun

    def __post_init__(self):
        if self.algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {', '.join(ALGORITHMS)}, got {self.algo!r}")
        if self.critic not in CRITICS:
            raise ValueError(f"critic must be one of {', '.join(CRITICS)}, got {self.critic!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, "
                             f"got {self.lr_schedule!r}")
        if self.kl_mode not in KL_MODES:
            raise ValueError(f"kl_mode must be one of {', '.join(KL_MODES)}, got {self.kl_mode!r}")
        for name in ("steps", "tasks_per_step", "micro_batch_tokens", "mini_batches", "epochs",
                     "critic_epochs", "kl_horizon", "max_rollout_rounds"):
            value = getattr(self, name)
            if name == "critic_epochs" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("warmup_steps", "critic_warmup_steps", "checkpoint_every", "max_staleness"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("policy_lr", "critic_lr", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("gamma", "lam", "critic_lam"):
            if getattr(self, name) is not None and not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        if self.micro_batch_tokens < self.rollout.context_budget:
            raise ValueError(f"micro_batch_tokens ({self.micro_batch_tokens}) must be at least "
                             f"rollout.context_budget ({self.rollout.context_budget}): a "
                             "sub-trace is never split")
        if self.loss_aggregation == "seq-mean-token-sum-norm" and not self.loss_norm_constant:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs loss_norm_constant "
                             "(Dr. GRPO's constant length, e.g. the max new tokens)")
        if self.algo == "grpo" and self.kl_mode == "reward" and self.kl_coef > 0:
            raise ValueError("kl_mode='reward' needs algo='ppo': GRPO's advantages come from "
                             "outcome rewards only; use kl_mode='loss'")
        if self.filter_groups and self.rollout.samples_per_task < 2:
            raise ValueError("filter_groups needs rollout.samples_per_task >= 2 (a group of one "
                             f"rollout never varies), got {self.rollout.samples_per_task}")
        if self.max_rollout_rounds > 1 and not self.filter_groups:
            raise ValueError(f"max_rollout_rounds={self.max_rollout_rounds} needs filter_groups "
                             "(without it one round fills the batch)")
        for name in ("advantage_estimator", "policy_loss"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a registered name or 'package.module:function', "
                                 f"got {value!r}")
        if self.algo == "grpo" and self.critic_warmup_steps:
            raise ValueError("critic_warmup_steps needs algo='ppo' (GRPO has no critic)")
        if self.max_staleness and self.recompute_logprobs is False:
            raise ValueError("max_staleness > 0 needs recompute_logprobs=True (or None): the "
                             "proximal log-probs of asynchronous PPO are the learner's policy at "
                             "the start of the step, recomputed")
        if not self.partial_rollouts and not self.max_staleness:
            raise ValueError("partial_rollouts=False (abort-and-restart) applies to asynchronous "
                             "training: set max_staleness > 0, or leave partial_rollouts True")
        if self.max_staleness and self.tis_cap is None:
            raise ValueError("max_staleness > 0 needs tis_cap: each token's loss is weighted by "
                             "min(exp(proximal - behaviour log-prob), tis_cap)")

    @property
    def recomputes(self) -> bool:
        """Whether the old log-probs are recomputed (``recompute_logprobs``; None: when
        asynchronous)."""
        if self.recompute_logprobs is None:
            return self.max_staleness > 0
        return self.recompute_logprobs

    @property
    def advantage(self) -> str:
        """``advantage_estimator``, or the algorithm's default: GAE across sub-traces (PPO),
        group-relative outcome advantages (GRPO)."""
        if self.advantage_estimator is not None:
            return self.advantage_estimator
        return "grpo" if self.algo == "grpo" else "gae"

    @property
    def loss_aggregation(self) -> str:
        """``loss_agg_mode``, or the algorithm's default: token-mean (PPO), rollout-mean
        (GRPO)."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "rollout-mean" if self.algo == "grpo" else "token-mean"

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
MINI_BATCH_ORDERS = ("shuffle", "task")


@dataclass
class TrainConfig:
    """Everything a training run needs besides the models and the environment. The defaults
    are general-purpose; the main job (``RunConfig().train``) tunes some for the vault task,
    each with its reason (docs/reference/config.md lists both)."""

    algo: str = "ppo"
    """``"ppo"`` (a critic, GAE advantages) or ``"grpo"`` (no critic, group-relative outcome
    advantages). Decides whether there is a critic: a critic-free ``advantage_estimator``
    (REINFORCE++, RLOO) runs with ``"grpo"``."""
    seed: int = 0
    """Seeds episodes, task order and mini-batch order; the same seed gives the same run on the
    CPU. A run config's top-level ``seed`` replaces it."""
    steps: int = 10
    """Training steps (one batch of rollouts and its updates each); also where ``linear`` and
    ``cosine`` learning-rate schedules reach 0. A small number for trying the library out; set
    it to your run's length."""
    tasks_per_step: int = 8
    """Tasks rolled out per step, each ``rollout.samples_per_task`` times: the batch is their
    product in rollouts. Raise it for lower-variance updates at the cost of rollout time."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine's limits and sampling (``RolloutConfig``)."""
    micro_batch_tokens: int = 4096
    """Most tokens in one forward/backward (sub-traces packed, no padding; a sub-trace is never
    split, so at least ``rollout.context_budget``). Bounds activation memory, not the
    gradient: micro-batches accumulate. Lower it when a step runs out of memory; raise it to
    take a mini-batch in fewer passes."""
    mini_batches: int = 1
    """Optimizer steps per epoch: each epoch splits the batch into this many mini-batches of
    whole rollouts, one update each (``epochs * mini_batches`` policy updates a step). More
    updates learn more from each batch of rollouts; the later ones are further off-policy
    (the clip bounds them)."""
    mini_batch_order: str = "shuffle"
    """How each epoch's mini-batches are drawn: ``"shuffle"``, a seeded shuffle of the
    rollouts; ``"task"``, a seeded shuffle of the tasks, each task's rollouts kept together in
    one mini-batch and in one micro-batch, the scoring's too (a task over
    ``micro_batch_tokens`` is split; under torchrun ranks split by whole tasks), so its
    samples' shared first prompt is laid out once (``share_prefixes``). ``"task"`` changes the
    seeded order (other runs than ``"shuffle"``'s), and with fewer tasks than
    ``mini_batches`` there are as many mini-batches as tasks."""
    epochs: int = 1
    """Passes over each batch of rollouts (PPO's epochs)."""
    policy_lr: float = 1e-4
    """The policy's AdamW learning rate (peak, before ``lr_schedule``). Watch the step-1
    ``approx_kl``: too high a rate makes early updates large and can collapse the policy."""
    critic_lr: float = 1e-3
    """The critic's AdamW learning rate (the separate critic, or the shared critic's value
    head). Usually several times ``policy_lr``: the value targets move with the policy."""
    weight_decay: float = 0.0
    """AdamW weight decay of the policy and critic optimizers."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up (from ``1 / warmup_steps`` of the rate to all of
    it) before ``lr_schedule`` applies; for rates high enough that the first updates overshoot."""
    lr_schedule: str = "constant"
    """After warm-up: ``"constant"``, or ``"linear"`` / ``"cosine"`` decay to 0 at ``steps``."""
    max_grad_norm: float = 1.0
    """Gradient clipping: each optimizer step's global gradient norm is scaled down to at most
    this (the policy's and the separate critic's, each)."""
    gamma: float = 1.0
    """GAE's discount per action transition (not per token: an observation span between two
    actions counts once), in [0, 1]. 1 for episodic tasks scored at the end."""
    lam: float = 0.95
    """GAE's lambda for the policy's advantages, in [0, 1]: lower leans more on the critic's
    values (less variance, more of their bias); 1 makes each advantage the return minus the
    critic's value. 0.95 is the usual PPO value; with a sparse final reward over long traces,
    1 carries the outcome to every token."""
    lam_alpha: float | None = None
    """Length-adaptive lambda (VAPO, CompactionRL): each rollout's policy lambda is
    ``clamp(1 - 1 / (lam_alpha * l), 0, 1)`` with ``l`` its action-token count over all its
    sub-traces, in place of ``lam``: long rollouts get a lambda near 1 (little critic bias),
    short ones lean on the critic. VAPO uses 0.05, CompactionRL 1.5. None: ``lam``."""
    critic_lam: float | None = None
    """The critic's GAE lambda for its value targets (None: the policy's, ``lam`` or the
    adaptive one). Decoupled GAE (VC-PPO, VAPO): ``lam`` 1 gives the policy unbiased returns
    over long traces while the critic still learns from lower-variance targets."""
    gae_restart_at_compaction: bool = False
    """False: GAE's lambda-return continues through a compaction (each rollout's sub-traces as
    one sequence; with ``lam`` 1 every token's return is its rollout's return). True restarts
    it at each compaction, leaving everything after one to the critic's value there: on the
    vault task's 6-sub-trace episodes the outcome then reaches the early sub-traces only as fast
    as the critic learns it (docs/experiments.md)."""
    bootstrap_truncated: bool = True
    """A rollout cut by a limit (``max_turns``, ``max_total_tokens``, ...): True bootstraps it
    with the critic's value after its last token (the episode would have gone on); False
    scores it as terminal (bootstrap 0), for environments whose limits end the episode."""
    whiten_advantages: bool = True
    """GAE: normalize advantages to mean 0, std 1 over the batch's action tokens."""
    advantage_estimator: str | None = None
    """The advantage estimator, a name in ``agentrl_fast.train.advantages.ADVANTAGE_ESTIMATORS``
    (``"gae"``, ``"grpo"``, or one registered with ``register_advantage``) or
    ``"package.module:function"``; None: ``"gae"`` for ppo, ``"grpo"`` for grpo."""
    policy_loss: str = "ppo"
    """The policy loss, a name in ``agentrl_fast.train.losses.POLICY_LOSSES`` (``"ppo"``, or one
    registered with ``register_policy_loss``) or ``"package.module:function"``."""
    loss_agg_mode: str | None = None
    """How token losses are weighted into the batch's loss (docs/design.md, "Loss
    aggregation"): ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``, ``rollout-mean`` (each rollout
    once). None: ``token-mean`` for ppo, ``rollout-mean`` for grpo."""
    loss_norm_constant: float | None = None
    """``seq-mean-token-sum-norm``'s constant length in tokens (Dr. GRPO; e.g. the most new
    tokens); required by that mode, unused by the others."""
    clip_low: float = 0.2
    """PPO's clip below 1: the probability ratio stops counting under ``1 - clip_low``."""
    clip_high: float = 0.28
    """PPO's clip above 1: the ratio stops counting over ``1 + clip_high``. Wider than
    ``clip_low`` (DAPO's clip-higher), so unlikely tokens can still gain probability."""
    dual_clip: float | None = None
    """Dual-clip PPO's constant ``c > 1``: for negative advantages the loss is at most
    ``-A * c``, bounding a huge ratio's update; None: off."""
    value_clip: float | None = 0.2
    """The value loss's clip: new values count at most this far (in the returns' units) from
    the values at scoring; None: unclipped."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the policy loss; above 0 against entropy
    collapse."""
    kl_coef: float = 0.0
    """Weight of the KL to a frozen reference copy of the policy (made only when > 0); the
    initial value when ``kl_target`` adapts it."""
    kl_mode: str = "loss"
    """Where the KL goes: ``"loss"`` (a term of the policy loss, ``kl_estimator``) or
    ``"reward"`` (k1 per token subtracted from the rewards before GAE; ppo only)."""
    kl_estimator: str = "k3"
    """The in-loss KL estimator: ``k1`` (``logp - ref``), ``k2`` (``(logp - ref)^2 / 2``), ``k3``
    (``exp(ref - logp) - (ref - logp) - 1``, always >= 0, low variance)."""
    kl_target: float | None = None
    """Adaptive KL (Ziegler et al.): after each step ``kl_coef`` rises when the reference KL
    (k1, mean per action token) is above this target and falls when below; None: ``kl_coef``
    stays fixed."""
    kl_horizon: int = 100
    """Adaptive KL's horizon in episodes: a step with ``n`` rollouts moves ``kl_coef`` by up to
    20 % times ``n / kl_horizon``."""
    tis_cap: float | None = None
    """Truncated importance sampling: each token's loss is weighted by
    ``min(exp(old - rollout log-prob), tis_cap)``, correcting a mismatch between the sampler
    and the trainer (another backend, staleness); None: off. Needed with ``max_staleness > 0``."""
    critic: str = "separate"
    """``"separate"``: a critic model initialised from the policy's backbone, with its own
    optimizer; ``"shared"``: a value head on the policy's backbone trained in the same backward
    (``value_coef``): cheaper, but the value loss shares the policy's features."""
    value_coef: float = 0.5
    """``critic="shared"``: the value loss's weight in the shared backward
    (``pg + value_coef * value loss``)."""
    critic_warmup_steps: int = 0
    """Critic pre-training (CompactionRL's value pre-training): this many extra steps before RL
    step 1, outside ``steps``, each on a fresh batch of rollouts of the unchanged policy, whose
    value targets (GAE returns, ``critic_lam`` or the policy's lambda) train only the critic
    (the separate critic's ``critic_epochs`` passes; a shared critic's value head alone, the
    backbone frozen, in ``epochs`` passes), so its values are sensible before they shape
    advantages. The policy, its optimizer, both learning-rate schedules, the KL coefficient and
    the step count do not move (``critic_warmup`` metrics rows, numbered 1..N)."""
    critic_epochs: int | None = None
    """The separate critic's epochs over the batch, on the same mini-batches (verl's critic
    ``ppo_epochs``); None: ``epochs``."""
    overlap_critic: bool = True
    """On the CPU (one process, 2+ threads): the separate critic's update of a mini-batch runs
    in a thread beside the policy's, each on half the intra-op threads."""
    recompute_logprobs: bool | None = True
    """True: the old log-probs PPO's ratio starts from are recomputed by one more forward of the
    policy over the batch, and the rollout/trainer mismatch is reported. False: the rollout's
    own sampling log-probs (the same policy and temperature, so equal up to float rounding),
    saving that forward (verl's bypass mode); needs a generator that records the policy's
    log-probs, as TorchGenerator does. None: recomputed exactly when asynchronous
    (``max_staleness > 0``)."""
    max_staleness: int = 0
    """Asynchronous training (docs/training.md): rollouts are produced beside the learner, and
    a rollout is trained on only while its oldest token is at most this many versions (learner
    steps) behind. 0: synchronous (roll out, then learn). Needs the recomputed (proximal)
    log-probs and ``tis_cap``."""
    partial_rollouts: bool = True
    """Asynchronous: a rollout whose weights change mid-episode keeps its turns with the
    versions that sampled them (partial rollouts); False restarts its whole group from the
    first turn on the new weights (abort-and-restart: every rollout on one version, at the cost
    of the discarded turns; a group slower than a learner step may restart more than once)."""
    grpo_normalize_std: bool = True
    """GRPO: divide each rollout's reward minus its group's mean by the group's standard
    deviation; False keeps the centred reward (Dr. GRPO)."""
    filter_groups: bool = False
    """Dynamic sampling (DAPO): train only on task groups whose rollouts' rewards differ (a
    group that agrees has zero advantage under GRPO), rolling out up to
    ``max_rollout_rounds`` batches to find ``tasks_per_step`` of them. Needs
    ``rollout.samples_per_task >= 2``."""
    max_rollout_rounds: int = 1
    """``filter_groups``: most batches of ``tasks_per_step`` tasks rolled out in one step to
    fill it; a step that finds none skips the update."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (a folder of ``step-NNNNNNNNN`` directories); None: no checkpoints.
    A folder that holds one is resumed with ``Trainer(resume=True)`` and is an error without
    it."""
    checkpoint_every: int = 0
    """Steps between checkpoints in ``checkpoint_dir``; 0: only the final one, written when
    ``Trainer.train`` returns (with no ``checkpoint_dir``, none). Above 0 needs
    ``checkpoint_dir``. Lower it to lose fewer steps to a crash, at the cost of more writes."""
    keep_checkpoints: int | None = 3
    """The newest checkpoints kept in ``checkpoint_dir`` (older ones are deleted after each
    write); None: all."""
    share_prefixes: bool = True
    """Tree packing: in each micro-batch, sub-traces that begin with the same tokens before
    their first action token (the system prompt, tools header, a task's first prompt) are laid
    out with that prefix once, and the policy, critic and reference run it once (the
    ``prefix_of`` mode of ``varlen_attention``). Exact: per-token log-probs, values and
    gradients equal the plain packing's within float rounding; the warm-start shares too.
    Falls back to the plain packing, with one log line, for a model whose attention would
    ignore shared prefixes (not agentrl_fast's packed attention). False: the plain packing
    (bit-identical to runs before the option)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """How the run uses N ranks under ``torchrun`` (``DistributedConfig``)."""

    def __post_init__(self):
        if self.algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {', '.join(ALGORITHMS)}, got {self.algo!r}")
        if self.critic not in CRITICS:
            raise ValueError(f"critic must be one of {', '.join(CRITICS)}, got {self.critic!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, "
                             f"got {self.lr_schedule!r}")
        if self.mini_batch_order not in MINI_BATCH_ORDERS:
            raise ValueError(f"mini_batch_order must be one of {', '.join(MINI_BATCH_ORDERS)}, "
                             f"got {self.mini_batch_order!r}")
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
        if self.lam_alpha is not None and not (isinstance(self.lam_alpha, (int, float))
                                               and 0 < self.lam_alpha < float("inf")):
            raise ValueError(f"lam_alpha must be a number > 0 (or None: lam), got "
                             f"{self.lam_alpha!r}")
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

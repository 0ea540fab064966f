"""The configuration's schema: one dataclass per YAML section, each field with its type,
default and meaning (its ``#:`` comment; docs/config.md is generated from them by
tools/gen_config_doc.py), and the allowed values of the keys that take a choice.
Reading, overriding and validating a config: :mod:`dept_mega.config`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .config_error import ConfigError  # noqa: F401 - importable from here (and dept_mega.config)
from .variant import VARIANT_NAMES


# Every field's meaning is its ``#:`` comment (above the field, or after it on its line):
# docs/config.md is generated from them (tools/gen_config_doc.py); a section's is its docstring.


@dataclass
class ModelConfig:
    """The transformer (decoder-only, pre-norm, causal)."""
    num_layers: int = 12  #: Transformer blocks.
    hidden_size: int = 768  #: Width of the residual stream.
    num_attention_heads: int = 12  #: Query heads per layer.
    num_query_groups: Optional[int] = None  #: Key/value heads (grouped-query attention); null = one per query head.
    ffn_hidden_size: Optional[int] = None  #: Hidden width of the MLP; null = 4 × hidden_size.
    activation: str = "gelu"  #: MLP activation (swiglu: gated, two input projections).
    normalization: str = "layernorm"  #: Norm before attention, before the MLP and after the last block.
    position_embedding: str = "alibi"  #: How positions enter: ALiBi attention bias, rotary, or a learned table.
    seq_length: int = 2048  #: Tokens per training sample.
    tie_embeddings: bool = True  #: The output head reuses the input embedding table.
    norm_eps: float = 1.0e-5  #: Epsilon of the norms.
    rope_theta: float = 10000.0  #: Rotary base frequency (position_embedding: rope).
    init_method_std: float = 0.02  #: Standard deviation of the normal weight initialisation.
    hidden_dropout: float = 0.0  #: Dropout on the attention and MLP outputs.
    attention_dropout: float = 0.0  #: Dropout on the attention probabilities.
    bias: bool = False  #: Biases in the linear layers.
    #: LayerNorm with a bias; false: weight only, as MPT's (needed to export ALiBi models to
    #: Hugging Face); RMSNorm has no bias either way.
    norm_bias: bool = True
    #: Vocabulary size when no tokenizer is configured (tests, benchmarks); otherwise the
    #: tokenizer's size is used.
    vocab_size: Optional[int] = None
    #: Attention kernel; auto picks flash-attn, flex_attention, SDPA or a materialised bias for
    #: this device and position embedding (the run log's `backends:` line says which).
    attention_backend: str = "auto"
    #: Activation recomputation in backward: selective = the attention core, full = whole blocks.
    recompute: str = "none"
    recompute_layers: Optional[int] = None  #: recompute full: only the first N blocks of each pipeline chunk; null = all.

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class ParallelConfig:
    """The layout of one source group: world size = groups × data × pipeline × tensor."""
    tensor: int = 1  #: Tensor-parallel size T (keep it within a node).
    pipeline: int = 1  #: Pipeline stages P (1F1B schedule).
    data: int = 1  #: Data-parallel replicas D inside each source group.
    sequence_parallel: bool = False  #: Shard the norms' and dropouts' activations over the tensor ranks.
    virtual_pipeline: int = 1  #: Model chunks per pipeline stage; > 1 runs the interleaved 1F1B schedule.


@dataclass
class OuterOptimizerConfig:
    """How the averaged pseudo-gradient of a round updates the shared weights."""
    #: fedavg: θ ← θ − lr·Δ̄ (lr 1 = plain averaging); nesterov: SGD with Nesterov momentum;
    #: adam: Adam on the pseudo-gradients.
    name: str = "fedavg"
    lr: float = 1.0  #: Outer learning rate.
    momentum: float = 0.0  #: Momentum μ of nesterov.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  #: β1, β2 of adam.
    eps: float = 1.0e-8  #: ε of adam.


@dataclass
class DeptConfig:
    """DEPT: which variant, how often groups synchronise and what crosses between them."""
    #: std: one group, batches mix all sources; glob, trim, spec, spec_opt: one source per group
    #: per round with global, trimmed, per-source embeddings, or per-source tokenizer too.
    variant: str = "spec_opt"
    local_steps: int = 500  #: Inner steps per round between outer synchronisations (train.steps must be a multiple).
    #: How sources are weighted: for STD's batch mix, and for drawing G of K > G sources each round.
    #: uniform: alike; proportional: ∝ tokens × weight; temperature: ∝ (tokens × weight)^τ;
    #: weights: ∝ data.sources[i].weight alone, whatever the sizes (Megatron-LM's --data-path 0.3 A 0.7 B);
    #: balanced (DEPT only): no draw at random, every source trained once before any is trained
    #: again (shuffled cycles, seeded by train.seed; with data.sources[].group, per group).
    sampling: str = "uniform"
    temperature: float = 1.0  #: τ of sampling temperature: shares ∝ (tokens × weight)^τ (0: uniform, 1: proportional).
    #: SPEC / SPEC-OPT with K > G: when this run's round plans (train.steps / dept.local_steps rounds,
    #: drawn with train.seed) train some source in no round, its own embeddings would stay as they
    #: start (seeded at random, or train.init_from's): error refuses the launch (and --check), warn
    #: only warns (a short trial run). Other variants always only warn.
    untrained_sources: str = "error"
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    reset_inner_optimizer: bool = False  #: Clear the inner AdamW state at the start of every round.
    #: Who owns the body's inner AdamW state: the group (DiLoCo) or the source (it moves with
    #: the source from group to group).
    body_optimizer_state: str = "group"
    #: What the outer sync sends: fp32 or bf16 (all-reduced), or fp8 / int8 / int4 block-wise
    #: scaled (all-gathered, reduced in fp32).
    outer_comm_dtype: str = "fp32"
    outer_quant_block: int = 256  #: Values per scale of the fp8 / int8 / int4 outer sync.
    outer_error_feedback: bool = False  #: Carry each rank's quantisation residual into the next sync.
    outer_state_device: str = "device"  #: Where θ_{t-1} and the outer optimizer state live (cpu saves device memory).
    outer_overlap: bool = False  #: Launch the outer sync and keep training while it runs (Streaming DiLoCo).
    outer_delay: int = 0  #: τ: inner steps between launching an overlapped sync and applying it (0: blocking).
    #: How an overlapped sync lands: correction (θ_t plus the τ local steps), eager (the τ steps
    #: start from an estimate of θ_t), mix (α·local + (1 − α)·θ_t).
    outer_overlap_rule: str = "correction"
    outer_mix_alpha: float = 0.5  #: α of outer_overlap_rule mix, in [0, 1].
    outer_fragments: int = 1  #: Split the body into F fragments of consecutive layers, synchronised staggered.
    trim_table_device: str = "cpu"  #: Where TRIM's global embedding table lives.
    #: GLOB: which embedding rows a group's inner steps update: all, or only the ids present in
    #: the round's source data.
    embedding_rows: str = "all"


@dataclass
class SourceConfig:
    """One data source (``data.sources`` list item)."""
    name: str = ""  #: The source's name, used in logs, metrics and checkpoints.
    prefix: str = ""  #: Path prefix of its Megatron indexed data (PREFIX.bin and PREFIX.idx).
    tokenizer: Optional[str] = None  #: Its own tokenizer (spec_opt only): a SentencePiece model or a Hugging Face tokenizer, as data.tokenizer.
    weight: float = 1.0  #: Multiplies the source's token count in proportional / temperature sampling, or is its share under dept.sampling=weights (normalised over the sources); a weight other than 1 is refused under uniform, where it would have no effect.
    #: The source group that holds its data and trains it (a site's data stays there): each
    #: round group g draws one of its own sources; null = index mod the number of groups when
    #: any source sets it or under federation with more sources than groups, else any group.
    group: Optional[int] = None
    #: Federation: this source's summary (python -m dept_mega.data.summary PREFIX), which a group
    #: job that does not hold the source reads instead of its files (token count, data identity,
    #: tokenizer size); null = PREFIX.summary.json. Never read by the job that holds the source.
    #: A job that reads the summary never opens the source's prefix or tokenizer: any path works.
    summary: Optional[str] = None


@dataclass
class DataConfig:
    """Tokenizers and data sources."""
    tokenizer: Optional[str] = None  #: The global tokenizer (every variant but spec_opt): a SentencePiece model (.model), or a Hugging Face tokenizer.json or a directory holding it (with tokenizer_config.json naming its eos_token); the kind is read from the path.
    sources: list[SourceConfig] = field(default_factory=list)  #: The data sources, one mapping each (keys below).
    split: str = "98,2"  #: Train,valid document weights of each source; a third weight holds out a test part, which only python -m dept_mega.evaluate --part test reads.
    cache_dir: Optional[str] = None  #: Where sample-index caches go (memory-mapped .npy files, built at start-up by the ranks between them, each part once; on a node-local disk, by each node's ranks for that node), and the token counts and id ranges computed from the data; null = beside each source's .idx.


@dataclass
class OptimConfig:
    """The inner optimizer: AdamW; its learning rate warms up linearly, then decays."""
    lr: float = 6.0e-4  #: Peak learning rate, reached after warmup_steps.
    min_lr: float = 6.0e-5  #: Learning rate at the end of the decay (lr_decay_steps) and after it; unused by constant.
    warmup_steps: int = 100  #: Steps of linear warmup.
    #: Decay after warmup (Megatron-LM's --lr-decay-style): cosine or linear from lr to min_lr
    #: at lr_decay_steps; constant (lr throughout); inverse-square-root (lr·√warmup_steps/√step,
    #: at least min_lr); wsd (warmup-stable-decay: lr, then lr_wsd_decay_style down to min_lr
    #: over the last lr_wsd_decay_steps of lr_decay_steps). Past lr_decay_steps: min_lr (not constant).
    lr_decay_style: str = "cosine"
    #: Step at which the decay reaches min_lr, counted from step 0 (warmup included; Megatron's
    #: --lr-decay-iters); null = train.steps. May be above train.steps (the run stops before
    #: min_lr) or below it (min_lr from there on); must be above warmup_steps.
    lr_decay_steps: Optional[int] = None
    #: wsd: the final decay's length in steps (Megatron's --lr-wsd-decay-iters); needed by wsd, refused otherwise.
    lr_wsd_decay_steps: Optional[int] = None
    #: wsd: the final decay's shape (Megatron's --lr-wsd-decay-style, the same default).
    lr_wsd_decay_style: str = "exponential"
    weight_decay: float = 0.1  #: AdamW decoupled weight decay, on the weights and embeddings (≥ 2-D), not on norms or biases.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  #: AdamW β1, β2.
    eps: float = 1.0e-8  #: AdamW ε.
    clip_grad: float = 1.0  #: Clip the global gradient norm to this (0: no clipping).
    max_consecutive_nonfinite: int = 10  #: Stop the run after this many skipped (inf/nan) steps in a row.
    #: Megatron's distributed optimizer (ZeRO-1): fp32 masters and AdamW moments sharded over
    #: the group's data-parallel ranks.
    distributed: bool = False
    grad_dtype: str = "fp32"  #: Dtype of the gradient accumulation and reduction buffer (bf16 needs precision bf16).
    overlap_grad_reduce: bool = True  #: Start each bucket's data-parallel reduction during backward.
    #: Gradient-accumulation fusion (Megatron's --gradient-accumulation-fusion): the weight-gradient
    #: GEMMs of the bf16 linear layers and the output head accumulate straight into the gradient buffer
    #: (no per-micro-batch param.grad and add). The native FP8 GEMMs fuse it too with fp8_gemm cublaslt
    #: (the GEMM accumulates into the buffer; fp8_gemm auto takes cublaslt only with this key on, and an
    #: explicit cublaslt accumulates whatever it says), not with fp8_gemm torch (a bf16 dW, then an add);
    #: Transformer Engine's GEMMs never. Under train.compile the fused layers run outside the compiled
    #: graphs (a graph break each); the run log's `backends:` line names the accumulation call and which
    #: GEMMs it covers.
    grad_accum_fusion: bool = True
    grad_bucket_size: int = 25_000_000  #: Elements per gradient bucket (one data-parallel collective each).
    fused: Optional[bool] = None  #: AdamW kernel: null = fused on CUDA, foreach elsewhere; true / false force it.


@dataclass
class ProfileConfig:
    """``train.profile``: a torch.profiler trace of the inner steps after ``start`` and up to
    ``stop`` on the listed global ranks, written to ``RUN/profile/``."""
    start: int = 0  #: Trace the steps after this many inner steps.
    stop: int = 1  #: Last inner step traced.
    ranks: list[int] = field(default_factory=lambda: [0])  #: Global ranks that write a trace.


@dataclass
class TrainConfig:
    """The run: length, batch, logging, evaluation and checkpoints."""
    steps: int = 7000  #: Inner steps of the whole run (the learning-rate schedule's length).
    micro_batch_size: int = 4  #: Sequences per forward/backward pass on one rank.
    #: Sequences per optimizer step in each source group (not job-wide: the job trains
    #: groups × this many); must divide by micro_batch_size × parallel.data.
    global_batch_size: int = 256
    seed: int = 1234  #: Seed of the initial weights, data order, dropout and the round sampler.
    run_dir: str = "runs/example"  #: Directory of the run's config, metrics, logs and checkpoints.
    log_interval: int = 10  #: Steps between log lines and train records.
    #: Each train record also gives the RMS of every transformer block's output over the
    #: step's tokens (act_rms, act_rms_max; docs/metrics.md), measured only on the steps that
    #: log and read with the loss: the paper's activation-norm stability comparison.
    log_activation_norms: bool = False
    eval_interval: int = 500  #: Steps between evaluations on every source (0: only at the end).
    #: Validation global batches per source and evaluation, as Megatron-LM's --eval-iters:
    #: the first eval_iters × global_batch_size sequences of each source's validation part
    #: (all of it when smaller; never a sequence twice), the same under any parallel layout
    #: and micro_batch_size; an evaluation reads (forward only) that many sequences per source.
    eval_iters: int = 20
    #: Validation sequences per source and evaluation, instead of eval_iters ×
    #: global_batch_size (null: that product): the first eval_samples sequences of each
    #: part. For comparing runs whose global batches differ (STD's is groups × a DEPT
    #: group's): the study tool sets it to eval_iters × the group batch for every run.
    eval_samples: Optional[int] = None

    def eval_sequences(self) -> int:
        """Validation sequences per source and evaluation (before the part's own size caps it)."""
        return self.eval_samples if self.eval_samples is not None else self.eval_iters * self.global_batch_size
    save_interval: int = 500  #: Steps between checkpoints (0: only at the end).
    profile: Optional[ProfileConfig] = None  #: A torch.profiler trace of some steps; null = off.
    #: Seconds to wait for every rank at start-up; torch applies the same limit to later
    #: collectives on the world group (checkpoint barriers).
    init_timeout_s: float = 600.0
    #: Where the ranks train: auto = CUDA where torch can use it, else the CPU over gloo (the run
    #: log's backends: line ends with the device, and on the CPU why); cuda = refuse to start
    #: without a usable CUDA device, naming why (a CPU-only build of torch, no device visible in
    #: CUDA_VISIBLE_DEVICES, fewer devices than processes on the node, a driver too old for torch's
    #: CUDA); cpu = the CPU and gloo even where CUDA works (debugging). The examples/1b sbatch
    #: scripts pass cuda, so that a cluster job never trains on the CPU unnoticed.
    device: str = "auto"
    compile: bool = False  #: torch.compile each transformer block.
    keep_checkpoints: int = 0  #: Keep the newest N complete checkpoints (0: keep all).
    async_save: bool = False  #: Write checkpoints from a background thread after a host copy.
    #: Stop cleanly (checkpoint, exit 0; a relaunch resumes the same schedule) after a step that
    #: is a multiple of N; null = off (Megatron's --exit-interval).
    exit_interval: Optional[int] = None
    #: Stop cleanly (checkpoint, exit 0) once this many minutes of wall time since launch have
    #: passed, agreed by all ranks at a step boundary; null = off (Megatron's --exit-duration-in-mins).
    exit_duration_mins: Optional[float] = None
    #: Start a new run from the model weights of another run's checkpoint: its run directory (the
    #: newest verified checkpoint) or its checkpoints/step_N (Megatron's --load with --finetune /
    #: --no-load-optim). Optimizer state, step, consumed samples and data position start fresh;
    #: any layout; same model and tokenizer; the body (and any global table) at a round boundary.
    #: std, glob and trim start from a std, glob or trim checkpoint (TRIM's φ is the shared
    #: table); spec from spec (each source's table by name), std, glob or trim (every source's
    #: table := the shared table or φ); spec_opt from spec_opt only. Not used once train.run_dir
    #: holds a checkpoint of its own: that one is resumed. null = initialise from train.seed.
    init_from: Optional[str] = None
    #: SPEC/SPEC-OPT with train.init_from of a spec / spec_opt checkpoint: a source whose embeddings
    #: the checkpoint does not hold is an error (error) or seeded as in a new run (fresh).
    init_from_new_sources: str = "error"
    #: A resume whose data differs from what the checkpoint read (data.split, train.seed, or a
    #: source's .bin/.idx by content; a moved file is the same data) is refused, naming each change.
    #: true: resume anyway and log each change, for a deliberate change (a corrected corpus). The
    #: saved data positions then index the new data, and under another split or seed validation
    #: documents may already have been trained on. Checkpoints written after the resume record the new data.
    allow_data_change: bool = False
    #: Weights & Biases project to log to from rank 0 (WANDB_MODE=offline works without a network); null = off.
    wandb: Optional[str] = None
    #: TensorBoard events in RUN/tb/: null = when the tensorboard package is installed (silently
    #: none without it); true = wanted (a warning when the package is missing); false = none.
    tensorboard: Optional[bool] = None


@dataclass
class FederationConfig:
    """Source groups as separate jobs joined through a torchft lighthouse (docs/launching.md,
    "Federated source groups"); ``lighthouse: null`` is the single job."""
    #: host:port of the lighthouse (``python -m dept_mega.lighthouse``; the http://host:port it
    #: prints is taken too); null: every group in this one job, no federation.
    lighthouse: Optional[str] = None
    #: This job's group index in [0, groups); null: from the environment variable DEPT_GROUP.
    group: Optional[int] = None
    #: Number of group jobs expected (each trains its own sources: data.sources[].group, at
    #: least one each).
    groups: int = 1
    #: Fewest groups that may complete a round (the others' pseudo-gradients are not waited for);
    #: a round needs the larger of this and the lighthouse's --min-groups, and this job waits
    #: rather than train in a smaller quorum. The same in every group job (compared at a fresh
    #: start and a heal; not part of the run's identity: all jobs may change it across a restart).
    min_groups: int = 1
    #: Seconds survivors wait for a missing group: collectives and commits across groups, and
    #: a fresh run's first round waiting for every expected group.
    timeout_s: float = 60.0
    #: Seconds a quorum wait may last before the job gives up: it saves a checkpoint (at a round
    #: start) and exits with status 75, the requeue status of a preemption (a lighthouse that
    #: restarted has forgotten the quorum: a relaunched job asks the new one). null = wait forever.
    #: A wait that cannot end because the other group jobs finished the run (their records at the
    #: lighthouse) ends with status 3 instead, not for a requeue.
    quorum_give_up_s: Optional[float] = 3600.0
    #: The host name this job's torchft servers and store are advertised by to the other group
    #: jobs, and its cross-group Gloo connections listen on (torchft's default: the short host
    #: name; NCCL: set NCCL_SOCKET_IFNAME): fqdn = each node's fully qualified name,
    #: route = each node's IPv4 address on its route to the lighthouse, or a name / IP address
    #: the other sites reach (a group job of one node only: one of several nodes is refused at
    #: start); null = torchft's.
    advertise_host: Optional[str] = None


@dataclass
class Config:
    """A run's configuration: ``RUN/config.yaml`` holds the resolved one."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: str = "bf16"  #: Dtype of weights and activations; bf16 / fp16 keep fp32 masters in the optimizer.
    fp8: Optional[str] = None  #: FP8 GEMMs in the transformer blocks (needs precision bf16); null = off.
    #: FP8 scaling: from an amax history (delayed) or the current tensor. With train.compile and
    #: the native FP8 GEMMs (backend local, or auto without Transformer Engine), both trace the
    #: casts and GEMMs into the compiled blocks (same math as eager; delayed recompiles the blocks
    #: once, after the first training step).
    fp8_recipe: str = "delayed"
    fp8_amax_history: int = 1024  #: Delayed recipe: a step's scales come from the amaxes of this many previous training steps.
    #: Native FP8 GEMMs in the tensor cores' fast accumulation: none (every GEMM promotes its sums
    #: to fp32), forward (the forward GEMM only, as Transformer Engine), all; auto = none (with
    #: Transformer Engine: its own, as forward). GPU results only. On an H200 (docs/performance.md)
    #: forward was no faster than none (478 against 469 ms a step of the 1B model).
    fp8_fast_accum: str = "auto"
    fp8_first_last_layers_bf16: bool = False  #: Keep the first and last transformer block in bf16.
    #: Native FP8 casts: auto (on CUDA cuda where the dept_mega.ops extension has its CUDA kernels, else
    #: triton when Triton imports, else torch; on CPU torch: the run log says which, and why not cuda), cuda
    #: (a C++/CUDA operator of the extension, dept_mega::cast_fp8: the fastest cast measured, 83-87 % of a
    #: copy's bandwidth on an H200, and a few µs of host time per cast where Triton's launcher takes more;
    #: on CPU it runs its CPU kernel), triton (one Triton kernel per cast; CUDA), torch (PyTorch ops,
    #: compiled on CUDA). Every path gives the same bytes (with fp8_fused_casts null the path also decides
    #: which producers fuse, below: a fused cast may round an element one FP8 step apart, rarely). Under train.compile the casts inside the
    #: compiled blocks are inductor's (from the PyTorch ops) unless triton is named: then each cast is
    #: the Triton kernel as one operator of the graph (dept_mega::fp8_cast, a Python-registered operator
    #: around the Triton kernel: not the C++ dept_mega::cast_fp8 of cuda; its GPU speed not yet measured).
    fp8_casts: str = "auto"
    #: Native FP8: fuse the producer of a linear's input into that input's FP8 cast, as Transformer
    #: Engine's LayerNormLinear / LayerNormMLP do: the LayerNorm before QKV and fc1 and the GELU before fc2
    #: are computed and cast in one pass (one kernel with fp8_casts triton or cuda; the LayerNorm only under
    #: delayed scaling from the second training step, otherwise normalised then cast) instead of
    #: writing the bf16 result and reading it again to cast it. In the backward the same holds for fc1's
    #: output gradient (dgelu): fc2's GELU backward writes it and fc1 casts it at once; fused, the GELU
    #: backward also writes its FP8 copies for fc1 (one kernel with the cuda casts; the torch casts
    #: run the same math apart), under delayed scaling from the second training step, with fc2's GELU
    #: fused (not with the triton casts). Same numbers as without (up to the kernels' rounding of erf /
    #: exp / rsqrt). null = auto: fuse only where the fused kernel was measured
    #: faster than the producer then the cast (H200, docs/performance.md): with the cuda casts every one
    #: (the LayerNorm before QKV and fc1 under delayed scaling, the GELU before fc2, dgelu), with the
    #: triton casts the LayerNorm (QKV, fc1; delayed scaling), with the torch casts, off a GPU, under
    #: train.compile or with Transformer Engine nothing; the run log says which linears fuse and why the
    #: others do not. true = fuse every producer that can be (refused with train.compile, without fp8
    #: and with Transformer Engine's linears); false = none. Fusion needs the eager native FP8 linears
    #: (backend local, or auto without Transformer Engine) and no collective between the producer and
    #: the GEMM: QKV and fc1 with parallel.tensor 1, fc2 (and dgelu) at any tensor-parallel size; RMSNorm
    #: and SwiGLU stay unfused.
    fp8_fused_casts: Optional[bool] = None
    #: Native FP8 GEMMs: auto, torch (torch._scaled_mm) or cublaslt (the C++ operator dept_mega::fp8_gemm
    #: of the dept_mega.ops extension, cuBLASLt called directly with its algorithm cached per shape; on CPU
    #: its CPU kernel). With cublaslt the weight-gradient GEMM of a training step accumulates into the
    #: gradient buffer inside the GEMM (beta = 1), as the bf16 layers' gradient-accumulation fusion does,
    #: instead of a bf16 dW then an add: one kernel less per weight and micro-batch, and slightly different
    #: (more precise: no bf16 rounding of dW) numbers. Eager FP8 linears only (cublaslt is refused with
    #: train.compile, whose traced GEMMs are torch._scaled_mm). auto = cublaslt on CUDA where the extension
    #: has the operator, without train.compile, with optim.grad_accum_fusion on and optim.grad_dtype fp32;
    #: otherwise torch (the run log says why).
    fp8_gemm: str = "auto"
    #: With the cublaslt FP8 GEMMs: on the first call of each GEMM problem (shape, layout, types,
    #: accumulation) time this many of the algorithms cuBLASLt's heuristic proposes and keep the fastest for
    #: the run (one host synchronisation per candidate, once per problem, within the first training step);
    #: 0 or 1: the heuristic's first, untimed. At most 64. Another algorithm sums in another order, and a
    #: timing can pick differently from run to run: a tuned run's last bits are not reproducible across
    #: processes (the run log lists each problem's candidates, their times and the one kept). Not applied
    #: to torch._scaled_mm (the run log says so when fp8_gemm auto does not take cublaslt).
    fp8_gemm_tuning: int = 0
    #: Linear layers: auto (Transformer Engine for every linear, bf16 runs included, when it imports on
    #: CUDA; else local), local (ours, with the fp8_* keys above) or transformer_engine. Transformer Engine
    #: has not yet run on a GPU here: every GPU figure in docs/performance.md ran our linears (local, or
    #: auto where Transformer Engine was not installed).
    backend: str = "auto"
    dept: DeptConfig = field(default_factory=DeptConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def num_groups(self, world_size: int) -> int:
        """G = world / (D·P·T): the number of source groups training concurrently."""
        p = self.parallel
        return world_size // (p.tensor * p.pipeline * p.data)


FP8_GEMM_MAX_TUNING = 64  # fp8_gemm_tuning's bound: the operator's (csrc/fp8_gemm.h, kFp8GemmMaxTune)

CHOICES: dict[str, tuple[Any, ...]] = {
    "model.activation": ("gelu", "swiglu"),
    "model.normalization": ("layernorm", "rmsnorm"),
    "model.position_embedding": ("alibi", "rope", "learned"),
    "model.attention_backend": ("auto", "flash", "flex", "sdpa", "bias"),
    "model.recompute": ("none", "selective", "full"),
    "precision": ("fp32", "bf16", "fp16"),
    "fp8": (None, "hybrid", "e4m3"),
    "fp8_recipe": ("delayed", "current"),
    "fp8_fast_accum": ("auto", "none", "forward", "all"),
    "fp8_casts": ("auto", "triton", "cuda", "torch"),
    "fp8_gemm": ("auto", "torch", "cublaslt"),
    "backend": ("auto", "local", "transformer_engine"),
    "dept.variant": VARIANT_NAMES,
    "dept.sampling": ("uniform", "proportional", "temperature", "weights", "balanced"),
    "dept.untrained_sources": ("error", "warn"),
    "dept.embedding_rows": ("all", "present"),
    "dept.outer_optimizer.name": ("fedavg", "nesterov", "adam"),
    "dept.outer_comm_dtype": ("fp32", "bf16", "fp8", "int8", "int4"),
    "dept.outer_state_device": ("device", "cpu"),
    "dept.outer_overlap_rule": ("correction", "eager", "mix"),
    "dept.body_optimizer_state": ("group", "source"),
    "dept.trim_table_device": ("cpu",),  # a table sharded over the outer group: not yet
    "optim.grad_dtype": ("fp32", "bf16"),
    "optim.lr_decay_style": ("cosine", "linear", "constant", "inverse-square-root", "wsd"),
    "optim.lr_wsd_decay_style": ("exponential", "linear", "cosine", "minus_sqrt"),
    "train.init_from_new_sources": ("error", "fresh"),
    "train.device": ("auto", "cuda", "cpu"),
}


#: The keys whose values are file system paths (``[]``: every item of the list). A relative one
#: is read from the current directory; in a run's ``config.yaml`` from the directory the run was
#: launched from, which the tools that read a run's config resolve it against
#: (:mod:`dept_mega.run_paths`). Every other string key is a choice (CHOICES) or in NOT_PATHS.
PATH_KEYS: tuple[str, ...] = (
    "data.tokenizer", "data.cache_dir", "data.sources[].prefix", "data.sources[].tokenizer",
    "data.sources[].summary", "train.run_dir", "train.init_from",
)
#: The string keys that are neither paths nor choices (names, a split, a project, host names).
NOT_PATHS: tuple[str, ...] = (
    "data.sources[].name", "data.split", "train.wandb", "federation.lighthouse", "federation.advertise_host",
)


def get_key(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node

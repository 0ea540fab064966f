"""Megatron-LM command-line flags and the dept_mega config keys that replace them.

The entry points that take ``key=value`` overrides (``dept_mega.train``, ``dept_mega.evaluate``,
``tools/benchmark.py``) parse their arguments with :func:`parse_with_hints`: a Megatron-LM flag
given as an option (``--tensor-model-parallel-size 2``) is refused, as any unknown option is,
with the override that says the same (``parallel.tensor=2``) instead of argparse's bare
"unrecognized arguments". :data:`MEGATRON_FLAGS` is the flag column of docs/migrating.md's
"Megatron-LM arguments" table (tests/test_megatron_flags.py keeps the two in step and checks
every key against the config schema).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

MIGRATING = "docs/migrating.md"


@dataclass(frozen=True)
class Flag:
    """What a Megatron-LM flag becomes: the override ``key=value``. ``key`` None: no key (the
    ``note`` says why). ``switch``: the flag takes no argument. ``value``: the override's value
    (a switch's, or a placeholder where the flag's argument does not carry over as it is);
    None: the flag's own argument, through ``convert`` when given."""
    key: Optional[str]
    switch: bool = False
    value: Optional[str] = None
    convert: Optional[Callable[[str], str]] = None
    note: str = ""


def _lower(text: str) -> str:
    return text.lower()


def _minutes_to_seconds(text: str) -> str:
    try:
        return f"{float(text) * 60:g}"
    except ValueError:
        return "SECONDS"


# Megatron's "none" (no position embedding at all) has no equivalent: the hint lists the choices
_POSITIONS = {"learned_absolute": "learned", "rope": "rope",
              "none": "alibi|rope|learned (no key for Megatron's 'none', no position embedding)"}
_RECIPES = {"delayed": "delayed", "tensorwise": "current"}

#: Megatron-LM flag -> its dept_mega config key (docs/migrating.md, "Megatron-LM arguments").
MEGATRON_FLAGS: dict[str, Flag] = {
    "--num-layers": Flag("model.num_layers"),
    "--hidden-size": Flag("model.hidden_size"),
    "--ffn-hidden-size": Flag("model.ffn_hidden_size"),
    "--num-attention-heads": Flag("model.num_attention_heads"),
    "--group-query-attention": Flag("model.num_query_groups", switch=True, value="N",
                                    note="N: Megatron's --num-query-groups"),
    "--num-query-groups": Flag("model.num_query_groups"),
    "--seq-length": Flag("model.seq_length"),
    "--swiglu": Flag("model.activation", switch=True, value="swiglu"),
    "--normalization": Flag("model.normalization", convert=_lower),
    "--norm-epsilon": Flag("model.norm_eps"),
    "--position-embedding-type": Flag("model.position_embedding", convert=lambda v: _POSITIONS.get(v, v)),
    "--rotary-base": Flag("model.rope_theta"),
    "--untie-embeddings-and-output-weights": Flag("model.tie_embeddings", switch=True, value="false"),
    "--disable-bias-linear": Flag("model.bias", switch=True, value="false"),
    "--hidden-dropout": Flag("model.hidden_dropout"),
    "--attention-dropout": Flag("model.attention_dropout"),
    "--init-method-std": Flag("model.init_method_std"),
    "--make-vocab-size-divisible-by": Flag(None, note="no key: the vocabulary is always padded to a multiple of 128"),
    "--micro-batch-size": Flag("train.micro_batch_size"),
    "--global-batch-size": Flag("train.global_batch_size", note="per source group"),
    "--train-iters": Flag("train.steps"),
    "--lr": Flag("optim.lr"),
    "--min-lr": Flag("optim.min_lr"),
    "--lr-decay-style": Flag("optim.lr_decay_style", convert=_lower),
    "--lr-decay-iters": Flag("optim.lr_decay_steps"),
    "--lr-wsd-decay-style": Flag("optim.lr_wsd_decay_style"),
    "--lr-wsd-decay-iters": Flag("optim.lr_wsd_decay_steps"),
    "--lr-warmup-iters": Flag("optim.warmup_steps"),
    "--weight-decay": Flag("optim.weight_decay"),
    "--adam-beta1": Flag("optim.betas", value="[B1,B2]", note="both betas in one list"),
    "--adam-beta2": Flag("optim.betas", value="[B1,B2]", note="both betas in one list"),
    "--adam-eps": Flag("optim.eps"),
    "--clip-grad": Flag("optim.clip_grad"),
    "--bf16": Flag("precision", switch=True, value="bf16"),
    "--fp16": Flag("precision", switch=True, value="fp16"),
    "--fp8-format": Flag("fp8"),
    "--fp8-recipe": Flag("fp8_recipe", convert=lambda v: _RECIPES.get(v, v)),
    "--fp8-amax-history-len": Flag("fp8_amax_history"),
    "--transformer-impl": Flag("backend"),
    "--use-flash-attn": Flag("model.attention_backend", switch=True, value="flash"),
    "--tensor-model-parallel-size": Flag("parallel.tensor"),
    "--pipeline-model-parallel-size": Flag("parallel.pipeline"),
    "--num-layers-per-virtual-pipeline-stage": Flag("parallel.virtual_pipeline", value="CHUNKS",
                                                    note="model chunks per stage: num_layers / (pipeline × L)"),
    "--sequence-parallel": Flag("parallel.sequence_parallel", switch=True, value="true"),
    "--use-distributed-optimizer": Flag("optim.distributed", switch=True, value="true"),
    "--overlap-grad-reduce": Flag("optim.overlap_grad_reduce", switch=True, value="true", note="on by default"),
    "--ddp-bucket-size": Flag("optim.grad_bucket_size"),
    "--gradient-accumulation-fusion": Flag("optim.grad_accum_fusion", switch=True, value="true",
                                           note="on by default"),
    "--accumulate-allreduce-grads-in-fp32": Flag("optim.grad_dtype", switch=True, value="fp32",
                                                 note="the default"),
    "--recompute-granularity": Flag("model.recompute"),
    "--recompute-method": Flag(None, note="no key: block is the only method (model.recompute_layers)"),
    "--recompute-num-layers": Flag("model.recompute_layers"),
    "--save": Flag("train.run_dir", note="one directory for --save and --load"),
    "--load": Flag("train.run_dir", note="one directory for --save and --load; another run's weights: "
                                         "train.init_from"),
    "--finetune": Flag("train.init_from", switch=True, value="OTHER_RUN", note="the run whose weights to start from"),
    "--no-load-optim": Flag("train.init_from", switch=True, value="OTHER_RUN",
                            note="the run whose weights to start from"),
    "--no-load-rng": Flag("train.init_from", switch=True, value="OTHER_RUN",
                          note="the run whose weights to start from"),
    "--save-interval": Flag("train.save_interval"),
    "--async-save": Flag("train.async_save", switch=True, value="true"),
    "--exit-interval": Flag("train.exit_interval"),
    "--exit-duration-in-mins": Flag("train.exit_duration_mins"),
    "--exit-signal-handler": Flag(None, switch=True, note="no key: always on"),
    "--eval-interval": Flag("train.eval_interval"),
    "--eval-iters": Flag("train.eval_iters"),
    "--data-path": Flag("data.sources", value="[{name: a, prefix: A}, ...]",
                        note="one entry per source, best in the config file"),
    "--split": Flag("data.split"),
    "--data-cache-path": Flag("data.cache_dir"),
    "--tokenizer-type": Flag(None, note="no key: the type is read from data.tokenizer's path (a SentencePiece "
                                        ".model, a Hugging Face tokenizer.json or its directory)"),
    "--tokenizer-model": Flag("data.tokenizer"),
    "--seed": Flag("train.seed"),
    "--distributed-timeout-minutes": Flag("train.init_timeout_s", convert=_minutes_to_seconds, note="seconds"),
    "--log-interval": Flag("train.log_interval"),
    "--tensorboard-dir": Flag(None, note="no key: TensorBoard files go to RUN/tb/"),
    "--wandb-project": Flag("train.wandb"),
    "--profile": Flag("train.profile", switch=True, value="{start: S, stop: E}"),
    "--profile-step-start": Flag("train.profile.start"),
    "--profile-step-end": Flag("train.profile.stop"),
    "--profile-ranks": Flag("train.profile.ranks", value="[R, ...]"),
}


def override_for(flag: str, argument: Optional[str]) -> str:
    """What to write instead of Megatron-LM's ``flag`` (given ``argument``, None: none seen):
    ``key=value``, with the note in parentheses when there is one; a flag with no key: its note."""
    f = MEGATRON_FLAGS[flag]
    if f.key is None:
        return f.note
    if f.value is not None:
        value = f.value
    elif argument is None:
        value = "VALUE"
    else:
        value = f.convert(argument) if f.convert is not None else argument
    return f"{f.key}={value}" + (f" ({f.note})" if f.note else "")


def unknown_flags_message(unknown: Sequence[str], argv: Sequence[str]) -> str:
    """The error for the options argparse did not recognise (``unknown``, in the order of
    ``argv``): for Megatron-LM's flags the overrides that replace them, for the rest argparse's
    words and how keys are set."""
    hints: list[str] = []
    others: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(unknown):
        token = unknown[i]
        name, eq, argument = token.partition("=")
        flag = MEGATRON_FLAGS.get(name)
        if flag is None:
            others.append(token)
            i += 1
            continue
        arg: Optional[str] = argument if eq else None
        if arg is None and not flag.switch and token in argv:
            at = argv.index(token) + 1  # its argument (argparse took it for an override, or left it)
            if at < len(argv) and not argv[at].startswith("--"):
                arg = argv[at]
                if i + 1 < len(unknown) and unknown[i + 1] == arg:
                    i += 1
        hints.append(f"{name}: {override_for(name, arg)}")
        i += 1
    parts = []
    if hints:
        parts.append(f"Megatron-LM flags are not options here; config keys are set as key=value overrides: "
                     f"{'; '.join(hints)} "
                     f"(every flag and its key: {MIGRATING})")
    if others:
        parts.append(f"unrecognized arguments: {' '.join(others)} (config keys are set as key=value overrides, "
                     f"e.g. parallel.tensor=2: docs/config.md; Megatron-LM's flags: {MIGRATING})")
    return "; ".join(parts)


def parse_with_hints(ap: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """``ap.parse_intermixed_args(argv)`` (key=value overrides may come before, between or after
    the options), except that unrecognised options exit through ``ap.error`` with
    :func:`unknown_flags_message`."""
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = ap.parse_known_intermixed_args(argv)
    if unknown:
        ap.error(unknown_flags_message(unknown, argv))
    return args
